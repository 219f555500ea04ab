"""Preference-model rewards from local weights: CLIP score, PickScore, HPSv2 and the LAION aesthetic predictor.

Registered in :mod:`jagg.rewards.registry` as ``clip_score``, ``pickscore``, ``hpsv2`` and ``aesthetic``; options go in
the name (``pickscore:path=/models/PickScore_v1,processor=/models/CLIP-ViT-H-14-laion2B-s32B-b79K``). Each is a
transformers ``CLIPModel`` run in torch, batched (``batch_size`` images per forward), on a given ``device`` and
``dtype`` (by default the trainer's), under ``no_grad``:

- ``clip_score``: ``logit_scale * cos(image, prompt) / 30`` (Flow-GRPO's ``ClipScorer``: ``logits_per_image / 30``;
  OpenAI's CLIP ViT-L/14 has ``logit_scale = 100``, so about ``3.3 cos``); the cosine is in ``info["clip_cosine"]``.
- ``pickscore``: PickScore (CLIP-H fine-tuned on Pick-a-Pic), ``logit_scale * cos / 26`` as Flow-GRPO's
  ``PickScoreScorer`` (``info["pickscore_raw"]`` is ``logit_scale * cos``, the paper's score).
- ``hpsv2``: HPS v2 / v2.1, an open_clip ViT-H-14 checkpoint; the score is ``cos`` (HPSv2's own ``score``, DanceGRPO
  and the JAGG authors). open_clip itself is not needed: its state dict is converted to a ``CLIPModel`` by
  :func:`open_clip_to_transformers`, an exact renaming (checked against a reference forward in the tests).
- ``aesthetic``: the LAION aesthetic predictor v2, an MLP on normalised CLIP ViT-L/14 image embeddings (prompt-free).

Images arrive as every reward takes them (:mod:`jagg.rewards.images`: uint8 ``[N, H, W, 3]`` or a float tensor
``[N, 3, H, W]`` in [-1, 1], which is not quantised) and are preprocessed in torch, batched, on the model's device, as
``CLIPImageProcessor`` does (its torchvision backend: resize of the shortest edge with antialiased bicubic
interpolation, centre crop, normalisation), or, for HPSv2, as open_clip's ``ResizeMaxSize`` (longest edge, zero
padding; the same as the crop for the square images a sampler makes). Nothing is downloaded: a missing path, or one
that does not hold what is expected, is a one-line ``FileNotFoundError`` / ``ValueError`` naming the path.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from ..checks import check_count, check_json_files, read_json
from .images import to_unit_float

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
RESAMPLE = {2: "bilinear", 3: "bicubic"}              # PIL's resample codes in image processor configs
HF_DOWNLOAD = "huggingface-cli download {repo} --local-dir <dir>"


def local_path(path, what: str, expected: str, repo: str) -> Path:
    """``path`` as an existing local :class:`~pathlib.Path`; otherwise a one-line FileNotFoundError naming it, what it
    must hold and where to get it (jagg never downloads weights)."""
    if not path:
        raise FileNotFoundError(f"{what}: no path given; expected {expected} (jagg never downloads weights: "
                                f"{HF_DOWNLOAD.format(repo=repo)} on a machine with internet)")
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{what}: {p} does not exist; expected {expected} (jagg never downloads weights: "
                                f"{HF_DOWNLOAD.format(repo=repo)} on a machine with internet)")
    return p


def _clip_dir(path, what: str, repo: str, need: str) -> Path:
    """A local transformers CLIP directory: ``config.json`` of ``model_type`` clip and, for ``need='processor'``, a
    ``preprocessor_config.json`` (transformers 5 writes ``processor_config.json``)."""
    expected = (f"a transformers CLIP model directory ({repo}: config.json and its weights)" if need == "model" else
                f"the CLIP processor directory of {repo} (config.json, preprocessor_config.json and the tokenizer)")
    p = local_path(path, what, expected, repo)
    config = p / "config.json"
    if not p.is_dir() or not config.is_file():
        raise ValueError(f"{what}: {p} is not a transformers model directory (no config.json); expected {expected}")
    check_json_files(p, what)                         # a broken JSON file names itself, not a decoder position
    model_type = read_json(config, what, "object").get("model_type")
    if model_type != "clip":
        raise ValueError(f"{what}: {p} holds a {model_type!r} model, not CLIP (model_type 'clip'); expected {expected}")
    if need == "processor" and not any((p / f).is_file() for f in ("preprocessor_config.json",
                                                                   "processor_config.json")):
        raise ValueError(f"{what}: {p} has no preprocessor_config.json (nor processor_config.json); expected "
                         f"{expected}")
    return p


def _positive_int(name: str, value) -> int:
    return check_count(value, name)


def _positive_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0; got {value!r}")
    return float(value)


def _device(device) -> torch.device:
    """``"auto"`` (cuda if available, else cpu), a device name or a ``torch.device``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got {device!r}") from None


def check_options(options: dict, required: tuple[str, ...], what: dict[str, str]) -> None:
    """A preference reward's options checked without loading anything (``jagg train --print-config`` and every config
    load): ``batch_size`` an integer >= 1, ``dtype`` and ``device`` known, and each of ``required`` given (``what``:
    what each holds). A ValueError names the option."""
    for name in required:
        if not options.get(name):
            raise ValueError(f"option {name}= is required: {what[name]} (e.g. {name}=/models/...); jagg never "
                             "downloads weights")
    if "batch_size" in options:
        _positive_int("option batch_size", options["batch_size"])
    dtype = options.get("dtype", "fp32")
    if isinstance(dtype, str) and dtype not in DTYPES:
        raise ValueError(f"option dtype must be one of {tuple(DTYPES)}; got {dtype!r}")
    if "device" in options and isinstance(options["device"], str):
        _device(options["device"])


class ClipImages:
    """``CLIPImageProcessor``'s image preprocessing in torch, batched: float ``[N, 3, H, W]`` in [0, 1] -> pixel values
    ``[N, 3, S, S]``.

    ``mode="crop"`` (the processor): resize the shortest edge to ``size`` (the longer one to ``int(size * long /
    short)``), centre crop to ``crop_size`` (offsets ``(H - h) // 2``), normalise with ``image_mean`` /
    ``image_std``. ``mode="pad"`` (open_clip's ``ResizeMaxSize``, HPSv2): resize the longest edge to the crop size
    (the other to ``round(edge * scale)``), pad the rest with zeros (black) centred, normalise. The resize is
    antialiased (bicubic for the processor's ``resample`` 3, bilinear for 2), clamped to [0, 1]."""

    def __init__(self, image_processor, mode: str = "crop"):
        cfg = image_processor.to_dict()
        if mode not in ("crop", "pad"):
            raise ValueError(f"mode must be 'crop' or 'pad'; got {mode!r}")
        resample = int(cfg.get("resample", 3))
        if resample not in RESAMPLE:
            raise ValueError(f"image processor resample {resample} is not supported (2 bilinear, 3 bicubic)")
        size, crop = cfg.get("size") or {}, cfg.get("crop_size") or {}
        self.mode, self.interpolation = mode, RESAMPLE[resample]
        self.do_resize, self.do_crop = bool(cfg.get("do_resize", True)), bool(cfg.get("do_center_crop", True))
        self.shortest = size.get("shortest_edge")
        self.size = None if self.shortest else (size.get("height"), size.get("width"))
        self.crop = (crop.get("height"), crop.get("width"))
        if None in self.crop or (self.shortest is None and None in self.size):
            raise ValueError(f"unsupported image processor sizes: size {size}, crop_size {crop}")
        self.mean = torch.tensor(cfg.get("image_mean"), dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(cfg.get("image_std"), dtype=torch.float32).view(1, 3, 1, 1)
        self.normalize = bool(cfg.get("do_normalize", True))

    def _resize(self, x: Tensor, size: tuple[int, int]) -> Tensor:
        if tuple(x.shape[-2:]) == size:
            return x
        return torch.nn.functional.interpolate(x, size=size, mode=self.interpolation, antialias=True,
                                               align_corners=False).clamp(0.0, 1.0)

    def __call__(self, x: Tensor) -> Tensor:
        h, w = x.shape[-2:]
        ch, cw = self.crop
        if self.mode == "pad":                                 # open_clip's ResizeMaxSize to a square crop size
            scale = max(ch, cw) / max(h, w)
            new = (round(h * scale), round(w * scale))
            x = self._resize(x, new)
            ph, pw = ch - new[0], cw - new[1]
            x = torch.nn.functional.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))
        else:
            if self.do_resize:
                size = self.size
                if self.shortest:                              # transformers' get_resize_output_image_size
                    longer = int(self.shortest * max(h, w) / min(h, w))
                    size = (longer, self.shortest) if w <= h else (self.shortest, longer)
                x = self._resize(x, size)
            if self.do_crop:
                h, w = x.shape[-2:]
                if h < ch or w < cw:
                    raise ValueError(f"images of {h}x{w} are smaller than the crop {ch}x{cw} after resizing")
                top, left = (h - ch) // 2, (w - cw) // 2
                x = x[..., top:top + ch, left:left + cw]
        if self.normalize:
            x = (x - self.mean.to(x.device)) / self.std.to(x.device)
        return x


class ClipReward:
    """A reward from a transformers ``CLIPModel``: batched embeddings of images and prompts; subclasses turn the
    normalised embeddings into scores (:meth:`score`).

    Args:
        load: ``device -> (CLIPModel, CLIPProcessor)``, called once the other arguments are checked; the model is then
            moved to ``device`` and ``dtype``, eval mode, no grad; the processor gives the tokenizer and the image
            settings.
        batch_size: images (and prompts) per forward.
        device: ``"auto"`` (cuda if available), ``"cpu"``, ``"cuda:1"``, or a ``torch.device``.
        dtype: ``"fp32"``, ``"bf16"``, ``"fp16"`` (or a torch dtype) of the model.
        image_mode: ``"crop"`` (CLIPImageProcessor) or ``"pad"`` (open_clip's ResizeMaxSize).
    """

    REQUIRED = {"path": "a local model directory or file"}   # option -> what it holds: given or refused at load

    @classmethod
    def check_options(cls, options: dict) -> None:
        """The spec's options checked at config load, before anything loads (:func:`check_options`)."""
        check_options(options, tuple(cls.REQUIRED), cls.REQUIRED)

    def __init__(self, load: Callable[[torch.device], tuple[nn.Module, object]], batch_size: int = 32, device="auto",
                 dtype="fp32", image_mode: str = "crop"):
        self.batch_size = _positive_int("batch_size", batch_size)
        if isinstance(dtype, str) and dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}; got {dtype!r}")
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.device = _device(device)
        model, processor = load(self.device)                  # after the checks: the weights are large
        self.model = model.to(self.device, self.dtype).eval().requires_grad_(False)
        self.processor = processor
        self.images = ClipImages(processor.image_processor, image_mode)
        self.max_length = min(int(getattr(processor.tokenizer, "model_max_length", 77)),
                              int(self.model.config.text_config.max_position_embeddings))

    @torch.no_grad()
    def embed_images(self, images) -> Tensor:
        """Images (see :mod:`jagg.rewards.images`) -> L2-normalised image embeddings ``[N, E]`` fp32."""
        x = to_unit_float(images)
        out = []
        for s in range(0, x.shape[0], self.batch_size):
            pix = self.images(x[s:s + self.batch_size].to(self.device, torch.float32))
            out.append(_features(self.model.get_image_features(pixel_values=pix.to(self.dtype))))
        return torch.nn.functional.normalize(torch.cat(out).float(), dim=-1)

    @torch.no_grad()
    def embed_prompts(self, prompts: Sequence[str]) -> Tensor:
        """Prompts -> L2-normalised text embeddings ``[N, E]`` fp32 (truncated to the tokenizer's 77 tokens)."""
        out = []
        for s in range(0, len(prompts), self.batch_size):
            tok = self.processor.tokenizer(list(prompts[s:s + self.batch_size]), padding=True, truncation=True,
                                           max_length=self.max_length, return_tensors="pt")
            out.append(_features(self.model.get_text_features(input_ids=tok["input_ids"].to(self.device),
                                                              attention_mask=tok["attention_mask"].to(self.device))))
        return torch.nn.functional.normalize(torch.cat(out).float(), dim=-1)

    @property
    def logit_scale(self) -> float:
        return float(self.model.logit_scale.detach().float().exp())

    def score(self, cosine: Tensor) -> tuple[Tensor, dict]:
        """Per-image cosine ``[N]`` of image and prompt embeddings -> (scores ``[N]``, info)."""
        raise NotImplementedError

    def __call__(self, images, prompts: Sequence[str], metadata=None) -> tuple[np.ndarray, dict]:
        if len(prompts) != len(images):
            raise ValueError(f"got {len(images)} images but {len(prompts)} prompts")
        cosine = (self.embed_images(images) * self.embed_prompts(prompts)).sum(-1)
        scores, info = self.score(cosine)
        return scores.cpu().numpy().astype(np.float32), {k: v.cpu().numpy() for k, v in info.items()}


def _features(out) -> Tensor:
    """transformers 5 returns a model output with ``pooler_output`` (the projected embedding), 4.x the tensor."""
    return getattr(out, "pooler_output", out)


def _clip_loader(path, processor, what: str, repo: str, processor_repo: str):
    """``device -> (CLIPModel, CLIPProcessor)`` from local transformers directories (the processor's defaults to
    ``path``); the directories are checked when it is called."""
    def load(device: torch.device) -> tuple[nn.Module, object]:
        from transformers import CLIPModel, CLIPProcessor

        model_dir = _clip_dir(path, what, repo, "model")
        processor_dir = _clip_dir(processor or path, f"{what} processor", processor_repo, "processor")
        return (CLIPModel.from_pretrained(str(model_dir), local_files_only=True),
                CLIPProcessor.from_pretrained(str(processor_dir), local_files_only=True))
    return load


class ClipScoreReward(ClipReward):
    """CLIP score as Flow-GRPO's ``ClipScorer``: ``logit_scale * cos / normalize`` (normalize 30).

    ``path``: a local CLIP model directory (Flow-GRPO: ``openai/clip-vit-large-patch14``); ``processor``: its processor
    directory (default: ``path``)."""

    def __init__(self, path=None, processor=None, batch_size: int = 32, device="auto", dtype="fp32",
                 normalize: float = 30.0):
        repo = "openai/clip-vit-large-patch14"
        super().__init__(_clip_loader(path, processor, "clip_score", repo, repo), batch_size, device, dtype)
        self.normalize = _positive_float("normalize", normalize)

    def score(self, cosine):
        return self.logit_scale * cosine / self.normalize, {"clip_cosine": cosine}


class PickScoreReward(ClipReward):
    """PickScore (Kirstain et al. 2023) as Flow-GRPO's ``PickScoreScorer``: ``logit_scale * cos / normalize``
    (normalize 26, so scores are near 0.8-0.9).

    ``path``: local ``yuvalkirstain/PickScore_v1``; ``processor``: local ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``
    (its processor; default: ``path``)."""

    def __init__(self, path=None, processor=None, batch_size: int = 32, device="auto", dtype="fp32",
                 normalize: float = 26.0):
        super().__init__(_clip_loader(path, processor, "pickscore", "yuvalkirstain/PickScore_v1",
                                      "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"), batch_size, device, dtype)
        self.normalize = _positive_float("normalize", normalize)

    def score(self, cosine):
        raw = self.logit_scale * cosine
        return raw / self.normalize, {"pickscore_raw": raw}


def open_clip_to_transformers(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """An open_clip ``CLIP`` state dict (ViT image tower, the built-in text transformer: HPSv2's ViT-H-14) -> the state
    dict of the same model as a transformers ``CLIPModel``. Exact: a renaming, with each attention's fused
    ``in_proj`` split into ``q_proj`` / ``k_proj`` / ``v_proj`` and the two projections transposed (open_clip
    multiplies ``x @ proj``, a ``Linear`` computes ``x @ W.T``).

    ============================================  ===================================================================
    open_clip                                     transformers ``CLIPModel``
    ============================================  ===================================================================
    ``token_embedding.weight``                    ``text_model.embeddings.token_embedding.weight``
    ``positional_embedding``                      ``text_model.embeddings.position_embedding.weight``
    ``transformer.resblocks.i.*``                 ``text_model.encoder.layers.i.*`` (blocks below)
    ``ln_final.*``                                ``text_model.final_layer_norm.*``
    ``text_projection`` ``[W, E]``                ``text_projection.weight`` ``[E, W]``
    ``visual.conv1.weight``                       ``vision_model.embeddings.patch_embedding.weight``
    ``visual.class_embedding``                    ``vision_model.embeddings.class_embedding``
    ``visual.positional_embedding``               ``vision_model.embeddings.position_embedding.weight``
    ``visual.ln_pre.*`` / ``visual.ln_post.*``    ``vision_model.pre_layrnorm.*`` / ``vision_model.post_layernorm.*``
    ``visual.transformer.resblocks.i.*``          ``vision_model.encoder.layers.i.*``
    ``visual.proj`` ``[W, E]``                    ``visual_projection.weight`` ``[E, W]``
    ``logit_scale``                               ``logit_scale``
    block ``ln_1`` / ``ln_2``                     ``layer_norm1`` / ``layer_norm2``
    block ``attn.in_proj_{weight,bias}``          ``self_attn.{q,k,v}_proj.{weight,bias}`` (thirds, in that order)
    block ``attn.out_proj``                       ``self_attn.out_proj``
    block ``mlp.c_fc`` / ``mlp.c_proj``           ``mlp.fc1`` / ``mlp.fc2``
    ============================================  ===================================================================

    Both towers pool as open_clip does for these models (image: the class token after ``ln_post``; text: the token of
    the highest id, CLIP's end-of-text, which is where transformers pools), and both use exact GELU and LayerNorm eps
    1e-5. A key outside this table (a custom text tower, an attention pool, a ``logit_bias``) is a ValueError."""
    blocks = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj",
              "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
    top = {"token_embedding.weight": "text_model.embeddings.token_embedding.weight",
           "positional_embedding": "text_model.embeddings.position_embedding.weight",
           "ln_final.weight": "text_model.final_layer_norm.weight", "ln_final.bias": "text_model.final_layer_norm.bias",
           "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
           "visual.class_embedding": "vision_model.embeddings.class_embedding",
           "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
           "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
           "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
           "visual.ln_post.weight": "vision_model.post_layernorm.weight",
           "visual.ln_post.bias": "vision_model.post_layernorm.bias", "logit_scale": "logit_scale"}
    towers = {"visual.transformer.resblocks.": "vision_model.encoder.layers.",
              "transformer.resblocks.": "text_model.encoder.layers."}
    out: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        if key in top:
            out[top[key]] = value
        elif key in ("text_projection", "visual.proj"):
            out["text_projection.weight" if key == "text_projection" else "visual_projection.weight"] = value.t()
        elif key == "attn_mask":                               # older open_clip saved the causal mask as a buffer
            continue
        else:
            prefix = next((p for p in towers if key.startswith(p)), None)
            index, _, rest = key[len(prefix):].partition(".") if prefix else ("", "", "")
            if prefix is None or not index.isdigit():
                raise ValueError(f"open_clip key {key!r} is not part of a ViT CLIP with open_clip's built-in text "
                                 "transformer (HPSv2's ViT-H-14); cannot convert it")
            layer = f"{towers[prefix]}{index}."
            if rest.startswith("attn.in_proj_"):
                for name, part in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3)):
                    out[f"{layer}self_attn.{name}.{rest.rsplit('_', 1)[1]}"] = part
                continue
            module, _, param = rest.rpartition(".")
            if module not in blocks:
                raise ValueError(f"open_clip key {key!r}: unknown block module {module!r}")
            out[f"{layer}{blocks[module]}.{param}"] = value
    return out


class HPSv2Reward(ClipReward):
    """HPS v2 / v2.1 (Wu et al. 2023), the reward of DanceGRPO and the JAGG authors: ``cos(image, prompt)`` of an
    open_clip ViT-H-14 checkpoint (``HPS_v2_compressed.pt`` / ``HPS_v2.1_compressed.pt``), converted to a
    transformers ``CLIPModel`` by :func:`open_clip_to_transformers`; images preprocessed as open_clip's
    ``ResizeMaxSize`` (HPSv2's ``preprocess_val``).

    ``path``: the checkpoint file (a ``{"state_dict": ...}`` dict or the state dict itself); ``processor``: a local
    ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` directory, the same architecture as a transformers model: its
    ``config.json`` builds the model, its tokenizer and image processor settings (224 px, OpenAI's mean and std) are
    HPSv2's."""

    def __init__(self, path=None, processor=None, batch_size: int = 32, device="auto", dtype="fp32"):
        super().__init__(lambda dev: _load_hpsv2(path, processor, dev), batch_size, device, dtype, image_mode="pad")

    def score(self, cosine):
        return cosine, {}


def _load_hpsv2(path, processor, device: torch.device) -> tuple[nn.Module, object]:
    """HPSv2's checkpoint converted into a ``CLIPModel`` built (on ``device``) from the processor directory's config,
    and that directory's ``CLIPProcessor``."""
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor

    ckpt = local_path(path, "hpsv2", "an HPSv2 checkpoint file (HPS_v2.1_compressed.pt, an open_clip ViT-H-14 "
                      "state dict)", "xswu/HPSv2")
    if not ckpt.is_file():
        raise ValueError(f"hpsv2: {ckpt} is a directory; expected the HPSv2 checkpoint file "
                         "(HPS_v2.1_compressed.pt, an open_clip ViT-H-14 state dict)")
    processor_dir = _clip_dir(processor, "hpsv2 processor", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "processor")
    try:
        data = torch.load(ckpt, map_location="cpu", weights_only=True)
    except Exception as e:                            # a file that is not a torch checkpoint
        raise ValueError(f"hpsv2: {ckpt} is not a torch checkpoint ({type(e).__name__}); expected an open_clip "
                         "state dict such as HPS_v2.1_compressed.pt") from None
    state = data.get("state_dict", data) if isinstance(data, dict) else None
    if not isinstance(state, dict) or "visual.proj" not in state:
        raise ValueError(f"hpsv2: {ckpt} holds no open_clip CLIP state dict (no 'visual.proj'); expected an HPSv2 "
                         "checkpoint such as HPS_v2.1_compressed.pt")
    with torch.device(device):
        model = CLIPModel(CLIPConfig.from_pretrained(str(processor_dir), local_files_only=True))
    try:
        model.load_state_dict(open_clip_to_transformers(state), strict=True)
    except RuntimeError as e:
        raise ValueError(f"hpsv2: the checkpoint {ckpt} does not fit the CLIP architecture of {processor_dir}/"
                         f"config.json ({str(e).splitlines()[0]})") from None
    return model, CLIPProcessor.from_pretrained(str(processor_dir), local_files_only=True)


class AestheticReward(ClipReward):
    """LAION aesthetic predictor v2: an MLP on normalised CLIP ViT-L/14 image embeddings (prompt-free), about 1-10.

    ``path``: local ``openai/clip-vit-large-patch14``; ``head``: the MLP weights ``sac+logos+ava1-l14-linearMSE.pth``
    (keys ``layers.{0,2,4,6,7}.{weight,bias}``); ``processor``: default ``path``."""

    REQUIRED = {"path": "the local openai/clip-vit-large-patch14 directory",
                "head": "the aesthetic predictor's MLP weights, sac+logos+ava1-l14-linearMSE.pth"}

    def __init__(self, path=None, head=None, processor=None, batch_size: int = 32, device="auto", dtype="fp32"):
        head_path = local_path(head, "aesthetic head (option head=)", "the aesthetic predictor's MLP weights "
                               "sac+logos+ava1-l14-linearMSE.pth", "camenduru/improved-aesthetic-predictor")
        repo = "openai/clip-vit-large-patch14"
        super().__init__(_clip_loader(path, processor, "aesthetic", repo, repo), batch_size, device, dtype)
        try:
            state = torch.load(head_path, map_location="cpu", weights_only=True)
        except Exception as e:                        # a file that is not a torch checkpoint
            raise ValueError(f"aesthetic head: {head_path} is not a torch state dict ({type(e).__name__}); expected "
                             "sac+logos+ava1-l14-linearMSE.pth") from None
        keys = state if isinstance(state, dict) else {}
        layers = sorted({int(k.split(".")[1]) for k in keys if re.fullmatch(r"layers\.\d+\.weight", str(k))})
        if not layers:
            raise ValueError(f"aesthetic head: {head_path} is not an aesthetic-predictor state dict (no "
                             "'layers.N.weight' keys)")
        try:
            mods = [nn.Linear(state[f"layers.{i}.weight"].shape[1], state[f"layers.{i}.weight"].shape[0])
                    if i in layers else nn.Dropout(0.0) for i in range(max(layers) + 1)]
            self.head = nn.Sequential(*mods)
            self.head.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()})
        except (AttributeError, IndexError, RuntimeError) as e:     # weights of the wrong kind or shape
            raise ValueError(f"aesthetic head: {head_path} does not hold the aesthetic predictor's MLP weights "
                             f"({' '.join(str(e).split())[:160]})") from None
        self.head.to(self.device).eval()

    def __call__(self, images, prompts=None, metadata=None):
        with torch.no_grad():
            s = self.head(self.embed_images(images)).squeeze(-1)
        return s.cpu().numpy().astype(np.float32), {}
