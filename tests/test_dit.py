"""Tiny DiT (jagg.shapes.dit) and rectified-flow pretraining (jagg.shapes.pretrain): fast CPU units."""

import math
import os

import pytest
import torch

from jagg.shapes.dit import DiTConfig, TinyDiT, cfg_velocity, load_pretrained, save_pretrained
from jagg.shapes.pretrain import PretrainConfig, lr_at, pretrain

torch.set_num_threads(2)


def tiny_cfg(**kw) -> DiTConfig:
    base = dict(vocab_size=8, image_size=8, patch_size=2, dim=32, depth=2, heads=2,
                text_dim=16, text_heads=2, max_text_len=4)
    return DiTConfig(**{**base, **kw})


def randomized(model: TinyDiT, seed: int = 0) -> TinyDiT:
    """Give the zero-initialised (adaLN-Zero) layers random weights so the output depends on every input."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def inputs(cfg: DiTConfig, n: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cfg.channels, cfg.image_size, cfg.image_size, generator=g).to(dtype)
    sigma = torch.rand(n, generator=g).to(dtype)
    tokens = torch.randint(1, cfg.vocab_size, (n, cfg.max_text_len), generator=g)
    return x, sigma, tokens


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("kw, msg", [
    (dict(image_size=10, patch_size=4), "divisible by patch_size"),
    (dict(cfg_dropout=1.0), "cfg_dropout"),
    (dict(cfg_dropout=-0.1), "cfg_dropout"),
    (dict(dim=0), "positive int"),
    (dict(depth=2.0), "positive int"),
    (dict(dim=30, heads=4), "divisible by heads"),
    (dict(vocab_size=1), "vocab_size"),
])
def test_config_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        tiny_cfg(**kw)


def test_config_dict_round_trip():
    cfg = tiny_cfg(cfg_dropout=0.25)
    assert DiTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown keys"):
        DiTConfig.from_dict({**cfg.to_dict(), "bogus": 1})


# ----------------------------------------------------------------------------- forward


def test_default_config_param_count_and_shape():
    cfg = DiTConfig(vocab_size=256)
    model = TinyDiT(cfg)
    n = model.num_params()
    assert 0.8e6 < n < 2.5e6, n
    x = torch.randn(2, 3, 32, 32)
    v = model(x, torch.tensor([0.1, 0.9]), torch.randint(0, 256, (2, 16)))
    assert v.shape == x.shape and v.dtype == x.dtype


@pytest.mark.parametrize("n", [1, 3])
def test_shapes_any_batch_and_scalar_sigma(n):
    cfg = tiny_cfg()
    model = randomized(TinyDiT(cfg))
    x, sigma, tokens = inputs(cfg, n)
    assert model(x, sigma, tokens).shape == x.shape
    assert model(x, 0.5, tokens[:, :2]).shape == x.shape  # scalar sigma, shorter prompt
    with pytest.raises(ValueError, match="max_text_len"):
        model(x, sigma, torch.ones(n, cfg.max_text_len + 1, dtype=torch.long))


def test_batch_items_are_independent():
    cfg = tiny_cfg()
    model = randomized(TinyDiT(cfg))
    x, sigma, tokens = inputs(cfg, 4)
    tokens[1, 2:] = 0
    v = model(x, sigma, tokens)
    for i in range(4):
        torch.testing.assert_close(model(x[i:i + 1], sigma[i:i + 1], tokens[i:i + 1]), v[i:i + 1], atol=1e-5, rtol=1e-5)


def test_zero_init_output_is_zero():
    cfg = tiny_cfg()
    x, sigma, tokens = inputs(cfg, 3)
    v = TinyDiT(cfg)(x, sigma, tokens)
    assert torch.equal(v, torch.zeros_like(v))


def test_float64_forward_and_gradcheck():
    cfg = tiny_cfg(image_size=4, dim=8, depth=1, heads=2, text_dim=4, text_heads=1, max_text_len=3, mlp_ratio=2)
    model = randomized(TinyDiT(cfg)).double()
    x, sigma, tokens = inputs(cfg, 2, dtype=torch.float64)
    tokens[1, 1:] = 0
    v = model(x, sigma, tokens)
    assert v.dtype == torch.float64
    x.requires_grad_(True)
    sigma.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, s: model(a, s, tokens), (x, sigma), eps=1e-6, atol=1e-6, fast_mode=True)


def test_tokens_after_first_pad_are_ignored():
    cfg = tiny_cfg()
    model = randomized(TinyDiT(cfg))
    x, sigma, tokens = inputs(cfg, 2)
    tokens[:, 1] = 0  # prompts end after their first token
    v = model(x, sigma, tokens)
    t2 = tokens.clone()
    t2[:, 2:] = torch.randint(1, cfg.vocab_size, t2[:, 2:].shape)  # non-pad garbage after the first pad
    torch.testing.assert_close(model(x, sigma, t2), v, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(model(x, sigma, tokens[:, :1]), v, atol=1e-6, rtol=1e-6)  # trailing pads removed
    t3 = tokens.clone()
    t3[:, 0] = t3[:, 0] % (cfg.vocab_size - 1) + 1  # change a real token: the output must change
    assert not torch.allclose(model(x, sigma, t3), v)


def test_empty_prompt_is_finite_with_finite_grads():
    cfg = tiny_cfg()
    model = randomized(TinyDiT(cfg))
    x, sigma, _ = inputs(cfg, 3)
    v = model(x, sigma, torch.zeros(3, cfg.max_text_len, dtype=torch.long))
    assert torch.isfinite(v).all()
    v.square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ----------------------------------------------------------------------------- checkpoints


def test_save_load_round_trip(tmp_path):
    cfg = tiny_cfg(cfg_dropout=0.2)
    model = randomized(TinyDiT(cfg))
    path = tmp_path / "sub" / "dit.safetensors"
    save_pretrained(model, path)
    assert os.listdir(path.parent) == ["dit.safetensors"]  # single file, no temp left behind
    loaded = load_pretrained(path)
    assert loaded.config == cfg
    x, sigma, tokens = inputs(cfg, 2)
    assert torch.equal(loaded(x, sigma, tokens), model(x, sigma, tokens))
    save_pretrained(model, path)  # overwrite in place
    assert torch.equal(load_pretrained(path)(x, sigma, tokens), model(x, sigma, tokens))


# ----------------------------------------------------------------------------- guidance


def test_cfg_velocity_matches_formula_and_skips_uncond_at_one():
    cfg = tiny_cfg()
    model = randomized(TinyDiT(cfg))
    x, sigma, tokens = inputs(cfg, 3)
    empty = torch.zeros(1, 2, dtype=torch.long)  # broadcast over the batch, shorter than the prompt
    w = 4.5
    v_c = model(x, sigma, tokens)
    v_u = model(x, sigma, torch.zeros_like(tokens))
    torch.testing.assert_close(cfg_velocity(model, x, sigma, tokens, empty, w), v_u + w * (v_c - v_u), atol=1e-5, rtol=1e-5)

    calls = []
    h = model.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
    torch.testing.assert_close(cfg_velocity(model, x, sigma, tokens, empty, 1.0), v_c)
    cfg_velocity(model, x, sigma, tokens, empty, w)
    h.remove()
    assert calls == [3, 6]  # w = 1: cond only; otherwise one batched forward of [cond; uncond]


def test_cfg_velocity_detach_uncond_blocks_gradient():
    cfg = tiny_cfg()
    model = randomized(TinyDiT(cfg))
    x, sigma, tokens = inputs(cfg, 2)
    empty = torch.zeros_like(tokens)
    w = 3.0
    g = torch.randn_like(x)
    params = [p for p in model.parameters()]

    def grads(v):
        return torch.autograd.grad((v * g).sum(), params, allow_unused=True)

    got = grads(cfg_velocity(model, x, sigma, tokens, empty, w, detach_uncond=True))
    want = grads(w * model(x, sigma, tokens))  # only the cond branch carries gradient (scaled by w)
    full = grads(cfg_velocity(model, x, sigma, tokens, empty, w, detach_uncond=False))
    v_c, v_u = model(x, sigma, tokens), model(x, sigma, empty)
    want_full = grads(v_u + w * (v_c - v_u))
    for a, b, c, d in zip(got, want, full, want_full):
        if b is None:
            continue
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(c, d, atol=1e-5, rtol=1e-4)
    assert not all(torch.allclose(a, c) for a, c in zip(got, full) if a is not None)


# ----------------------------------------------------------------------------- pretraining

PALETTE = torch.tensor([[-1.0, -1, -1], [1, -1, -1], [-1, 1, -1], [-1, -1, 1], [1, 1, -1], [1, 1, 1]])


def solid_colours(gen: torch.Generator, n: int):
    """Toy data: token k in 1..6 -> a 8x8 image of solid colour PALETTE[k - 1]; prompts [k, 0, 0, 0]."""
    k = torch.randint(1, len(PALETTE) + 1, (n,), generator=gen)
    x0 = PALETTE[k - 1][:, :, None, None].expand(n, 3, 8, 8).clone()  # [n, 3, 8, 8]
    tokens = torch.zeros(n, 4, dtype=torch.long)
    tokens[:, 0] = k
    return x0, tokens


def test_pretrain_config_validation():
    with pytest.raises(ValueError, match="sigma_sampling"):
        PretrainConfig(sigma_sampling="beta")
    with pytest.raises(ValueError, match="ema_decay"):
        PretrainConfig(ema_decay=1.0)
    with pytest.raises(ValueError, match="steps"):
        PretrainConfig(steps=0)


def test_lr_schedule_warmup_then_cosine():
    c = PretrainConfig(steps=100, lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert lr_at(0, c) == pytest.approx(0.1) and lr_at(9, c) == pytest.approx(1.0)
    assert lr_at(99, c) == pytest.approx(0.1)
    assert all(lr_at(s, c) >= lr_at(s + 1, c) for s in range(10, 99))


def test_pretrain_is_deterministic_and_ema_runs():
    def run(ema_decay=None):
        torch.manual_seed(0)
        m = TinyDiT(tiny_cfg())
        return pretrain(m, solid_colours, PretrainConfig(steps=4, batch_size=8, warmup=1, seed=3, ema_decay=ema_decay))

    a, b = run(), run()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    e = run(ema_decay=0.5)
    assert all(torch.isfinite(p).all() for p in e.parameters())
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), e.parameters()))

    # snapshots (every 2 steps, before the last) hold the EMA copy: with a decay near 1 it is still the init
    snaps = {}
    torch.manual_seed(0)
    m = TinyDiT(tiny_cfg())
    init = [p.detach().clone() for p in m.parameters()]
    pretrain(m, solid_colours, PretrainConfig(steps=4, batch_size=8, warmup=1, seed=3, lr=1e-2, ema_decay=1 - 1e-9),
             snapshot=lambda step, w: snaps.update({step: [p.detach().clone() for p in w.parameters()]}),
             snapshot_every=2)
    assert list(snaps) == [2]
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(snaps[2], init))
    assert not all(torch.allclose(p, q, atol=1e-6) for p, q in zip(a.parameters(), init))  # training moves weights


def test_pretrain_loss_decreases_and_model_follows_prompt():
    torch.manual_seed(0)
    model = TinyDiT(tiny_cfg(cfg_dropout=0.1, pos_init="normal"))  # at 4x4 tokens the sin-cos start learns slower
    logs = []
    cfg = PretrainConfig(steps=100, batch_size=32, lr=3e-3, warmup=10, log_every=10, sigma_sampling="uniform",
                         ema_decay=None)
    pretrain(model, solid_colours, cfg, log=logs.append)
    losses = [d["loss"] for d in logs]
    assert len(logs) == 10 and logs[-1]["step"] == 100
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.4 * losses[0], losses  # ~1.9 -> ~0.3 in practice

    # Euler-sample each prompt from pure noise: the mean colour should land near its palette colour.
    g = torch.Generator().manual_seed(1)
    k = torch.arange(1, len(PALETTE) + 1).repeat(4)  # [24]
    tokens = torch.zeros(len(k), 4, dtype=torch.long)
    tokens[:, 0] = k
    x = torch.randn(len(k), 3, 8, 8, generator=g)
    sig = torch.linspace(1, 0, 11)
    with torch.no_grad():
        for s, s_next in zip(sig[:-1], sig[1:]):
            x = x + (s_next - s) * model(x, s.expand(len(k)), tokens)
    err = (x.mean(dim=(2, 3)) - PALETTE[k - 1]).abs().mean()
    assert err < 0.5, err
