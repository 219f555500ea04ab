"""The preference-model rewards (jagg.rewards.preference) on a tiny random CLIP built offline and saved to tmp
(tests/tiny_clip.py).

Registered by name with options (``pickscore:path=...``): the torch preprocessing against CLIPProcessor, scores
against transformers' own CLIPModel forward, batching, prompt sensitivity, the trainer's device and dtype, a weighted
mix with another reward, the reward server serving them by name, and one-line errors for missing or wrong paths.
HPSv2: an open_clip-format state dict (written by a small open_clip-like module built here, with open_clip's module
names and forward) converted to a CLIPModel gives that module's embeddings.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from jagg.rewards import RewardClient, get_reward, open_clip_to_transformers  # noqa: E402
from jagg.rewards.preference import ClipImages  # noqa: E402
from jagg.rewards.server import load_reward, make_server  # noqa: E402
from tiny_clip import EMBED, PATCH, SIDE, WIDTH, save_tiny_clip, tiny_vocab  # noqa: E402


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


def smooth_images(n=5, side=SIDE, seed=0) -> np.ndarray:
    """uint8 [n, side, side, 3]: random low-frequency images (bicubic resizing differs little between libraries)."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, 4, 4, generator=g)
    x = torch.nn.functional.interpolate(low, size=(side, side), mode="bilinear", align_corners=True)
    return (x * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


PROMPTS = ["a red cube", "a blue ball", "two cats", "a green cone", "the sea"]


def test_torch_preprocessing_is_the_clip_processors(clip_dir):
    proc = transformers.CLIPProcessor.from_pretrained(clip_dir)
    prep = ClipImages(proc.image_processor)
    for shape in ((SIDE, SIDE), (SIDE + 8, SIDE + 24), (SIDE + 24, SIDE)):
        ims = smooth_images(3, max(shape))[:, :shape[0], :shape[1]]
        want = proc(images=list(ims), return_tensors="pt")["pixel_values"]
        got = prep(torch.tensor(ims).permute(0, 3, 1, 2).float() / 255)
        assert got.shape == want.shape == (3, 3, SIDE, SIDE)
        # at the crop size there is no resizing: exact; PIL's and torch's bicubic resizing differ by about one 8-bit
        # level (0.015 after normalising, measured), PIL's resize also rounds to 8 bits
        tol = 1e-5 if shape == (SIDE, SIDE) else 0.03
        assert float((got - want).abs().max()) < tol, shape
    pad = ClipImages(proc.image_processor, mode="pad")
    wide = torch.rand(1, 3, SIDE // 2, SIDE)       # open_clip's ResizeMaxSize: the image centred, black above, below
    out, q = pad(wide), SIDE // 4
    torch.testing.assert_close(out[:, :, q:3 * q], (wide - pad.mean) / pad.std)
    black = ((0 - pad.mean) / pad.std).expand(1, 3, q, SIDE)
    torch.testing.assert_close(out[:, :, :q], black)
    torch.testing.assert_close(out[:, :, 3 * q:], black)
    square = torch.rand(2, 3, SIDE, SIDE)
    torch.testing.assert_close(pad(square), prep(square))       # square images: the two modes agree


def test_scores_are_clip_models_own_batched_and_prompt_sensitive(clip_dir):
    ims = smooth_images()
    model = transformers.CLIPModel.from_pretrained(clip_dir).eval()
    proc = transformers.CLIPProcessor.from_pretrained(clip_dir)
    with torch.no_grad():
        out = model(**proc(text=PROMPTS, images=list(ims), return_tensors="pt", padding=True))
    logits = out.logits_per_image.diagonal().numpy()                   # logit_scale * cos, transformers' forward
    pick, info = get_reward(f"pickscore:path={clip_dir},batch_size=2,device=cpu,dtype=fp32")(ims, PROMPTS, None)
    assert pick.shape == (5,) and pick.dtype == np.float32 and np.isfinite(pick).all()
    np.testing.assert_allclose(info["pickscore_raw"], logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pick, logits / 26, rtol=1e-5, atol=1e-6)
    clip, info = get_reward(f"clip_score:path={clip_dir},processor={clip_dir},batch_size=5")(ims, PROMPTS, None)
    np.testing.assert_allclose(clip, logits / 30, rtol=1e-5, atol=1e-6)
    assert np.all(np.abs(info["clip_cosine"]) <= 1 + 1e-6)
    # float input in [-1, 1] is not quantised: the same pixels give the same scores
    as_float = torch.tensor(ims).permute(0, 3, 1, 2).float() / 127.5 - 1
    np.testing.assert_allclose(get_reward(f"pickscore:path={clip_dir}")(as_float, PROMPTS, None)[0], pick, rtol=1e-5)
    # the same image with other prompts scores differently
    same = np.repeat(ims[:1], 5, axis=0)
    s, _ = get_reward(f"pickscore:path={clip_dir}")(same, PROMPTS, None)
    assert np.unique(np.round(s, 6)).size == 5


def test_device_and_dtype_come_from_the_trainer_unless_the_spec_sets_them(clip_dir):
    r = get_reward(f"pickscore:path={clip_dir}", {"device": torch.device("cpu"), "dtype": "bf16"})
    assert r.fn.model.dtype == torch.bfloat16 and r.fn.device == torch.device("cpu")
    s, _ = r(smooth_images(2), PROMPTS[:2], None)
    assert np.isfinite(s).all()
    r = get_reward(f"pickscore:path={clip_dir},dtype=fp32", {"device": "cpu", "dtype": "bf16"})
    assert r.fn.model.dtype == torch.float32
    assert get_reward("jpeg_compressibility", {"device": "cpu"})(smooth_images(1), ["x"], None)[0].shape == (1,)


def test_weighted_mix_with_another_reward(clip_dir):
    ims = smooth_images()
    mix = get_reward({f"pickscore:path={clip_dir}": 1.0, "jpeg_compressibility": 0.5})
    total, info = mix(ims, PROMPTS, None)
    pick, _ = get_reward(f"pickscore:path={clip_dir}")(ims, PROMPTS, None)
    jpeg, _ = get_reward("jpeg_compressibility")(ims, PROMPTS, None)
    np.testing.assert_allclose(info["scores/pickscore"], pick, rtol=1e-6)
    np.testing.assert_allclose(total, pick + 0.5 * jpeg, rtol=1e-5)
    assert "pickscore/pickscore_raw" in info and "jpeg_compressibility/jpeg_kb" in info
    with pytest.raises(ValueError, match="'pickscore' appears twice"):
        get_reward({f"pickscore:path={clip_dir}": 1.0, f"pickscore:path={clip_dir},batch_size=4": 1.0})


def test_served_by_name_through_the_reward_server(clip_dir):
    ims = smooth_images()
    server = make_server(load_reward(f"pickscore:path={clip_dir}", {"batch_size": 2}), port=0, name="pickscore")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        scores, info = RewardClient(url, batch_size=3, image_format="npy")(ims, PROMPTS)
    finally:
        server.shutdown()
        server.server_close()
    np.testing.assert_allclose(scores, get_reward(f"pickscore:path={clip_dir}")(ims, PROMPTS, None)[0], rtol=1e-5)


class _Block(nn.Module):
    """open_clip's ResidualAttentionBlock (names and forward): pre-norm attention and a 4x GELU MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(OrderedDict(c_fc=nn.Linear(width, 4 * width), gelu=nn.GELU(),
                                             c_proj=nn.Linear(4 * width, width)))

    def forward(self, x, mask=None):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class _Tower(nn.Module):
    def __init__(self, width, heads, layers):
        super().__init__()
        self.resblocks = nn.ModuleList([_Block(width, heads) for _ in range(layers)])

    def forward(self, x, mask=None):
        for block in self.resblocks:
            x = block(x, mask)
        return x


class _OpenClipViT(nn.Module):
    """open_clip's CLIP (ViT image tower, built-in text transformer) with its parameter names, as HPSv2's ViT-H-14."""

    def __init__(self, vocab: int, width=WIDTH, embed=EMBED, side=SIDE, patch=PATCH, layers=2, heads=2):
        super().__init__()
        g = side // patch
        self.token_embedding = nn.Embedding(vocab, width)
        self.positional_embedding = nn.Parameter(torch.randn(77, width) * 0.1)
        self.transformer = _Tower(width, heads, layers)
        self.ln_final = nn.LayerNorm(width)
        self.text_projection = nn.Parameter(torch.randn(width, embed) * 0.3)
        self.logit_scale = nn.Parameter(torch.tensor(2.6592))
        self.visual = nn.Module()
        self.visual.conv1 = nn.Conv2d(3, width, patch, patch, bias=False)
        self.visual.class_embedding = nn.Parameter(torch.randn(width) * 0.1)
        self.visual.positional_embedding = nn.Parameter(torch.randn(g * g + 1, width) * 0.1)
        self.visual.ln_pre, self.visual.ln_post = nn.LayerNorm(width), nn.LayerNorm(width)
        self.visual.transformer = _Tower(width, heads, layers)
        self.visual.proj = nn.Parameter(torch.randn(width, embed) * 0.3)
        with torch.no_grad():                                   # non-trivial norms and biases
            for name, p in self.named_parameters():
                if name.endswith(("ln_1.weight", "ln_2.weight", "ln_pre.weight", "ln_post.weight", "final.weight")):
                    p.add_(torch.randn_like(p) * 0.2)
                elif name.endswith("bias"):
                    p.normal_(0, 0.1)

    def encode_image(self, pix):
        v = self.visual
        x = v.conv1(pix).flatten(2).transpose(1, 2)
        x = torch.cat([v.class_embedding.expand(x.shape[0], 1, -1), x], dim=1) + v.positional_embedding
        x = v.transformer(v.ln_pre(x))
        return nn.functional.normalize(v.ln_post(x[:, 0]) @ v.proj, dim=-1)

    def encode_text(self, tokens):
        n = tokens.shape[1]
        causal = torch.full((n, n), float("-inf")).triu(1)
        x = self.transformer(self.token_embedding(tokens) + self.positional_embedding[:n], causal)
        x = self.ln_final(x)[torch.arange(tokens.shape[0]), tokens.argmax(-1)]
        return nn.functional.normalize(x @ self.text_projection, dim=-1)


def test_hpsv2_open_clip_checkpoint_converts_exactly(clip_dir, tmp_path):
    torch.manual_seed(1)
    ref = _OpenClipViT(len(tiny_vocab())).eval()
    torch.save({"state_dict": ref.state_dict()}, tmp_path / "HPS_v2.1_compressed.pt")
    hps = get_reward(f"hpsv2:path={tmp_path / 'HPS_v2.1_compressed.pt'},processor={clip_dir},batch_size=2")
    ims = smooth_images()
    scores, _ = hps(ims, PROMPTS, None)
    reward = hps.fn
    pix = reward.images(torch.tensor(ims).permute(0, 3, 1, 2).float() / 255)
    tokens = reward.processor.tokenizer(PROMPTS, padding=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want_img, want_txt = ref.encode_image(pix), ref.encode_text(tokens)
        torch.testing.assert_close(reward.embed_images(ims), want_img, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(reward.embed_prompts(PROMPTS), want_txt, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scores, (want_img * want_txt).sum(-1).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(reward.logit_scale, float(ref.logit_scale.detach().exp()), rtol=1e-6)
    with pytest.raises(ValueError, match="not part of a ViT CLIP"):
        open_clip_to_transformers({"text.transformer.layer.0.weight": torch.zeros(1)})


def test_missing_or_wrong_paths_are_one_line_errors(clip_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.bin").write_bytes(b"not a model")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "bert"}))
    torch.save({"weights": torch.zeros(2)}, tmp_path / "not_hps.pt")
    cases = [
        ("pickscore", FileNotFoundError, "pickscore: no path given; expected a transformers CLIP model directory"),
        (f"pickscore:path={tmp_path / 'missing'}", FileNotFoundError, f"{tmp_path / 'missing'} does not exist"),
        (f"pickscore:path={tmp_path / 'file.bin'}", ValueError, "is not a transformers model directory"),
        (f"clip_score:path={tmp_path / 'empty'}", ValueError, "no config.json"),
        (f"clip_score:path={other}", ValueError, "holds a 'bert' model, not CLIP"),
        (f"pickscore:path={clip_dir},processor={tmp_path / 'empty'}", ValueError, "pickscore processor:"),
        (f"hpsv2:path={tmp_path / 'not_hps.pt'},processor={clip_dir}", ValueError, "holds no open_clip CLIP state"),
        (f"hpsv2:path={tmp_path / 'file.bin'},processor={clip_dir}", ValueError, "is not a torch checkpoint"),
        (f"hpsv2:path={tmp_path},processor={clip_dir}", ValueError, "is a directory; expected the HPSv2 checkpoint"),
        (f"pickscore:path={clip_dir},size=3", ValueError, "unknown option(s) ['size']; its options: path, processor"),
        (f"pickscore:path={clip_dir},batch_size=0", ValueError, "batch_size must be an integer >= 1"),
        (f"pickscore:path={clip_dir},device=gpu", ValueError, "device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        (f"pickscore:path={clip_dir},dtype=float", ValueError, "dtype must be one of ('fp32', 'bf16', 'fp16')"),
        ("pickscore:path", ValueError, "'path' is not KEY=VALUE"),
    ]
    for spec, error, message in cases:
        with pytest.raises(error) as e:
            get_reward(spec)
        assert message in str(e.value) and "\n" not in str(e.value), spec
