"""Real diffusers architectures (tiny random configs, no downloads) through the jagg estimators.

SD3Transformer2DModel, FluxTransformer2DModel and QwenImageTransformer2DModel with 1-2 layers on 16x16 latents:
on-policy ratio 1, JAGG with 2-step groups equals exact, LoRA trains only adapters, the reference is the base model,
saved adapters load back through diffusers' own ``load_lora_weights``, the loader's errors, and a full load from a
local directory. Qwen-Image against its own pipeline: tests/test_qwen_image.py. The tiny models:
tests/tiny_pipelines.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import diffusers  # noqa: E402
from diffusers import FlowMatchEulerDiscreteScheduler  # noqa: E402
from gradient_checks import assert_rel, assert_window_two_is_exact  # noqa: E402
from tiny_pipelines import (C, D, DP, H, L, W, embeds, save_sd3_pipeline, tiny_flux, tiny_qwen, tiny_sd3,  # noqa: E402
                            tiny_vae)
from toy import flat_grad  # noqa: E402

import jagg  # noqa: E402
from jagg.integrations import (LoraSettings, PipelineConfig, PromptEmbeddings, RealModel, VelocityConfig,  # noqa: E402
                               adapters_disabled, add_lora, check_model_dir, load_lora, load_model,
                               load_pipeline_config, pack_latents, reference_velocity, unpack_latents,
                               velocity_adapter, adapter_format, save_adapter)
from jagg.integrations import decode_latents  # noqa: E402
from jagg.integrations import pipeline  # noqa: E402
from jagg.integrations.schedules import default_shift  # noqa: E402

B, T = 4, 6                  # samples, steps

MODELS = {"sd3": (tiny_sd3, VelocityConfig(cfg_scale=4.5)), "flux": (tiny_flux, VelocityConfig(guidance_embed=3.5)),
          "qwen_image": (tiny_qwen, VelocityConfig(cfg_scale=4.0))}


def rollout(v, seed=0, T=T):
    g = torch.Generator().manual_seed(seed)
    return jagg.sample_trajectories(v, torch.randn(B, C, H, W, generator=g), jagg.flow_sigmas(T, shift=3.0), 0.7,
                                    generator=g)


@pytest.fixture(params=["sd3", "flux", "qwen_image"])
def family(request):
    return request.param


def test_on_policy_ratio_is_one_and_jagg_pairs_equal_exact(family):
    make, vcfg = MODELS[family]
    model = make()
    cond, neg = embeds(family=family)
    v = velocity_adapter(model, cond, neg, vcfg)
    traj = rollout(v)
    assert_window_two_is_exact(model, v, traj)


@pytest.mark.parametrize("intermediate", ["fresh", "interp"])
def test_jagg_group_gradient_is_the_endpoint_vjp(family, intermediate):
    """W = 3 through the real transformers: the accumulated gradient is exactly J_a^T G_a + J_b^T G_b with
    G_a = sum_k (1 - alpha_k) g_k, G_b = sum_k alpha_k g_k (alpha by sigma), written out here step by step."""
    from jagg.knots import interval_alphas

    make, vcfg = MODELS[family]
    model = make()
    cond, neg = embeds(family=family)
    v = velocity_adapter(model, cond, neg, vcfg)
    traj = rollout(v)                                            # T = 6 -> groups [0, 1, 2], [3, 4, 5]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    cfg = jagg.EstimatorConfig(correction_p=0.0, mode="jagg", window=3, intermediate=intermediate, micro_batch=4)
    model.zero_grad(set_to_none=True)
    stats = jagg.policy_gradient(v, traj, adv, cfg)
    assert stats.jagg_frac_routed == 1.0 and stats.backward_items == B * 2 * 2
    got = flat_grad(model)

    model.zero_grad(set_to_none=True)
    lat, sig, K = traj.latents, traj.sigmas, traj.train_steps.numel()
    for group in ([0, 1, 2], [3, 4, 5]):
        al = interval_alphas(sig, group).float()
        a, b = group[0], group[-1]
        for i in range(B):
            idx = torch.tensor([i, i])
            v_ab = v(torch.stack([lat[i, a], lat[i, b]]), sig[[a, b]], idx)          # with grad
            Ga, Gb = torch.zeros_like(lat[i, a]), torch.zeros_like(lat[i, a])
            for j, k in enumerate(group):
                if j == 0 or j == len(group) - 1:
                    vk = v_ab[0 if j == 0 else 1].detach()
                elif intermediate == "fresh":
                    with torch.no_grad():
                        vk = v(lat[i, k][None], sig[k][None], idx[:1])[0]
                else:
                    vk = (traj.velocities[i, k] + (1 - al[j]) * (v_ab[0].detach() - traj.velocities[i, a])
                          + al[j] * (v_ab[1].detach() - traj.velocities[i, b]))
                vk = vk.clone().requires_grad_(True)
                out = jagg.step_loss(vk[None], lat[i, k][None], lat[i, k + 1][None], sig[k][None], sig[k + 1][None],
                                     float(sig[1]), traj.eta, traj.log_probs[i, k][None], adv[i][None], cfg.clip_range)
                (g,) = torch.autograd.grad(out.loss.sum() / (B * K), vk)
                Ga += (1 - al[j]) * g
                Gb += al[j] * g
            (v_ab[0] * Ga).sum().backward(retain_graph=True)
            (v_ab[1] * Gb).sum().backward()
    assert_rel(got, flat_grad(model))


def test_cfg_gradient_both_branches_by_default_and_detached_variant():
    """Default (Flow-GRPO, train.cfg = True): both CFG branches get gradient, w g_c + (1 - w) g_u. detach_uncond: the
    gradient changes to w g_c, whether the unconditional rows run separately without grad or batched and detached."""
    model = tiny_sd3()
    cond, neg = embeds()
    x, s, i = torch.randn(3, C, H, W), torch.tensor([0.9, 0.5, 0.2]), torch.tensor([0, 2, 3])
    weight = torch.linspace(-1, 1, 3 * C * H * W).view(3, C, H, W)

    def grad_of(cfg: VelocityConfig, c=cond, u=neg):
        model.zero_grad(set_to_none=True)
        v = velocity_adapter(model, c, u, cfg)(x, s, i)
        (v * weight).sum().backward()
        return v.detach(), flat_grad(model)

    v_both, g_both = grad_of(VelocityConfig(cfg_scale=4.5))
    _, g_cond = grad_of(VelocityConfig(), cond, None)
    _, g_uncond = grad_of(VelocityConfig(), PromptEmbeddings(neg.prompt_embeds.expand(4, -1, -1),
                                                             neg.pooled.expand(4, -1)), None)
    assert_rel(g_both, 4.5 * g_cond - 3.5 * g_uncond)
    for mode in ("separate", "batched"):
        v_det, g_det = grad_of(VelocityConfig(cfg_scale=4.5, detach_uncond=True, uncond_forward=mode))
        torch.testing.assert_close(v_det, v_both, rtol=1e-4, atol=1e-5)      # same velocity ...
        assert_rel(g_det, 4.5 * g_cond)                                      # ... another gradient
        assert float((g_det - g_both).norm() / g_both.norm()) > 0.1


def test_flux_packing_matches_diffusers_and_needs_guidance():
    x = torch.randn(2, C, H, W)
    packed = pack_latents(x)
    torch.testing.assert_close(packed, diffusers.FluxPipeline._pack_latents(x, 2, C, H, W))
    torch.testing.assert_close(unpack_latents(packed, H, W), x)
    from jagg.integrations.velocity_adapters import latent_image_ids
    torch.testing.assert_close(latent_image_ids(H, W),
                               diffusers.FluxPipeline._prepare_latent_image_ids(2, H // 2, W // 2, "cpu",
                                                                                torch.float32))
    cond, _ = embeds()
    with pytest.raises(ValueError, match="guidance_embed"):
        velocity_adapter(tiny_flux(), cond, None, VelocityConfig())


def test_bf16_weights_return_fp32_and_autocast_runs():
    model = tiny_sd3().to(torch.bfloat16)
    cond, neg = embeds()
    x, s, i = torch.randn(2, C, H, W), torch.tensor([0.9, 0.3]), torch.tensor([0, 3])
    v = velocity_adapter(model, cond, neg, VelocityConfig(cfg_scale=2.0))(x, s, i)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()
    v16 = velocity_adapter(model, cond, neg, VelocityConfig(cfg_scale=2.0, output_dtype="model"))(x, s, i)
    assert v16.dtype == torch.bfloat16
    va = velocity_adapter(tiny_sd3(), cond, neg, VelocityConfig(cfg_scale=2.0, autocast="bf16"))(x, s, i)
    assert va.dtype == torch.float32 and torch.isfinite(va).all()


def test_gradient_checkpointing_gives_the_same_gradient():
    cond, neg = embeds()
    x, s, i = torch.randn(2, C, H, W), torch.tensor([0.9, 0.3]), torch.tensor([0, 3])
    out = []
    for ckpt in (False, True):
        model = tiny_sd3()
        if ckpt:
            model.enable_gradient_checkpointing()
        v = velocity_adapter(model, cond, neg, VelocityConfig(cfg_scale=4.5))(x, s, i)
        v.square().sum().backward()
        out.append(flat_grad(model))
    assert_rel(out[1], out[0])


def test_lora_trains_only_adapters_and_reference_is_the_base_model(family):
    make, vcfg = MODELS[family]
    base = make()
    model = make()
    params = add_lora(model, LoraSettings(rank=4, alpha=8.0))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names) and len(params) == len(names)
    cond, neg = embeds(family=family)
    v = velocity_adapter(model, cond, neg, vcfg)
    ref = reference_velocity(v)
    traj = rollout(v, T=4)
    opt = torch.optim.SGD(params, lr=5.0)
    stats = jagg.policy_gradient(v, traj, torch.tensor([1.0, -1.0, 0.5, -0.5]),
                                 jagg.EstimatorConfig(correction_p=0.0, mode="jagg", window=2, micro_batch=4))
    assert stats.backward_items > 0
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
    # Qwen-Image's last block still has its text-stream outputs, which nothing reads: they get no gradient
    unused = (("transformer_blocks.1.attn.to_add_out.", "transformer_blocks.1.txt_mlp.") if family == "qwen_image"
              else ())
    assert all((p.grad is None) == n.startswith(unused) for n, p in model.named_parameters() if "lora_" in n)
    opt.step()
    x, s, i = traj.latents[:, 1], traj.sigmas[1].expand(B), torch.arange(B)
    with torch.no_grad():
        v_pol, v_ref = v(x, s, i), ref(x, s, i)
        v_base = velocity_adapter(base, cond, neg, vcfg)(x, s, i)
    assert (v_pol - v_ref).abs().max() > 1e-4                       # the update moved the policy
    torch.testing.assert_close(v_ref, v_base, rtol=1e-5, atol=1e-6)  # the reference did not move
    assert [n for n, p in model.named_parameters() if p.requires_grad] == names   # flags restored
    r = jagg.reference_velocities(ref, traj, micro_batch=4)
    assert r.shape == traj.velocities.shape


def test_saved_adapter_loads_back_with_diffusers_and_peft(tmp_path, family):
    """One saved adapter directory holds both formats: diffusers' load_lora_weights, peft's
    PeftModel.from_pretrained and jagg's loader each give the trained velocity (1e-5), and a directory with peft's
    files alone (a Flow-GRPO checkpoint's lora/) loads as well."""
    from peft import PeftModel

    make, vcfg = MODELS[family]
    model = make()
    add_lora(model, LoraSettings(rank=4, alpha=16.0))                # alpha != rank must survive the round trip
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    save_adapter(model, tmp_path / "adapter", family)
    assert {"pytorch_lora_weights.safetensors", "adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in (tmp_path / "adapter").iterdir()}
    cond, neg = embeds(family=family)
    x, s, i = torch.randn(2, C, H, W), torch.tensor([0.8, 0.4]), torch.tensor([0, 3])
    with torch.no_grad():
        want = velocity_adapter(model, cond, neg, vcfg)(x, s, i)
    # 1) diffusers' own loader, on a pipeline around a fresh base transformer
    if family == "sd3":
        pipe = diffusers.StableDiffusion3Pipeline(transformer=make(), scheduler=FlowMatchEulerDiscreteScheduler(),
                                                  vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                                                  tokenizer_2=None, text_encoder_3=None, tokenizer_3=None)
    elif family == "flux":
        pipe = diffusers.FluxPipeline(transformer=make(), scheduler=FlowMatchEulerDiscreteScheduler(), vae=None,
                                      text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    else:
        pipe = diffusers.QwenImagePipeline(transformer=make(), scheduler=FlowMatchEulerDiscreteScheduler(), vae=None,
                                           text_encoder=None, tokenizer=None)
    pipe.load_lora_weights(str(tmp_path / "adapter"))
    with torch.no_grad():
        got = velocity_adapter(pipe.transformer, cond, neg, vcfg)(x, s, i)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # 2) resuming training: jagg's loader, trainable again
    fresh = make()
    fresh.requires_grad_(False)
    params = load_lora(fresh, tmp_path / "adapter")
    assert params and all(p.requires_grad for p in params)
    with torch.no_grad():
        torch.testing.assert_close(velocity_adapter(fresh, cond, neg, vcfg)(x, s, i), want, rtol=1e-5, atol=1e-6)
    # 3) peft's own loader reads the same directory
    peft_model = PeftModel.from_pretrained(make(), str(tmp_path / "adapter"))
    with torch.no_grad():
        got = velocity_adapter(peft_model, cond, neg, vcfg)(x, s, i)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # 4) peft's files alone, as Flow-GRPO saves them: jagg's loader takes them too
    only_peft = tmp_path / "flow_grpo_lora"
    only_peft.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (only_peft / name).write_bytes((tmp_path / "adapter" / name).read_bytes())
    assert adapter_format(only_peft) == "peft" and adapter_format(tmp_path / "adapter") == "diffusers"
    fresh = make()
    fresh.requires_grad_(False)
    assert all(p.requires_grad for p in load_lora(fresh, only_peft))
    with torch.no_grad():
        torch.testing.assert_close(velocity_adapter(fresh, cond, neg, vcfg)(x, s, i), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load_lora(make(), tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no LoRA adapter: expected pytorch_lora_weights"):
        adapter_format(tmp_path / "empty", "pipeline.lora.path")


def test_lora_settings_defaults_and_errors():
    assert LoraSettings().resolved("sd3")[:2] == (32, 64.0)
    assert LoraSettings().resolved("flux")[:2] == (64, 128.0)
    assert "ff_context.net.2" in LoraSettings().resolved("flux")[2]
    rank, alpha, targets = LoraSettings().resolved("qwen_image")       # Flow-GRPO's Qwen-Image LoRA
    assert (rank, alpha) == (64, 128.0) and {"attn.add_q_proj", "attn.to_out.0", "img_mlp.net.2"} <= set(targets)
    add_lora(tiny_qwen(), LoraSettings(rank=2))                         # every default target is a Linear layer
    assert LoraSettings(rank=8).resolved("sd3")[:2] == (8, 16.0)
    with pytest.raises(ValueError, match="rank"):
        LoraSettings(rank=0)
    with pytest.raises(ValueError, match="match no Linear"):
        add_lora(tiny_sd3(), LoraSettings(rank=2, target_modules=["attn.nonexistent"]))
    with pytest.raises(ValueError, match="no LoRA adapter to disable"):
        with adapters_disabled(tiny_sd3()):
            pass


def test_prompt_embedding_cache_roundtrip(tmp_path):
    cond, _ = embeds()
    uniq = cond.select([0, 2])
    for suffix in (".safetensors", ".pt"):
        uniq.save(tmp_path / f"cache{suffix}")
        back = PromptEmbeddings.load(tmp_path / f"cache{suffix}")
        assert back.prompts == uniq.prompts
        torch.testing.assert_close(back.lookup(["a blue ball", "a red cube"]).pooled, uniq.pooled.flip(0))
    torch.save({p: (uniq.prompt_embeds[k], uniq.pooled[k]) for k, p in enumerate(uniq.prompts)}, tmp_path / "d.pt")
    torch.testing.assert_close(PromptEmbeddings.load(tmp_path / "d.pt").prompt_embeds, uniq.prompt_embeds)
    with pytest.raises(KeyError, match="not in the prompt-embedding cache"):
        uniq.lookup(["a green cone"])
    with pytest.raises(FileNotFoundError, match="python -m jagg.integrations.pipeline cache"):
        PromptEmbeddings.load(tmp_path / "missing.safetensors")


def test_prompts_of_their_own_length_pad_with_a_mask_and_round_trip(tmp_path):
    """Qwen-Image's embeddings: rows of L and L - 2 tokens are zero-padded to L with a mask; each row comes back
    unpadded (the cache entry), the cache files keep the mask and no pooled embedding, and families without a text
    mask refuse them."""
    cond, neg = embeds(family="qwen_image")
    assert cond.pooled is None and cond.prompt_embeds.shape == (4, L, D)
    assert cond.mask.tolist() == [[True] * L] * 2 + [[True] * (L - 2) + [False] * 2] * 2
    assert (cond.prompt_embeds[2:, L - 2:] == 0).all()
    assert cond.row(2).prompt_embeds.shape == (1, L - 2, D) and cond.row(2).mask is None
    same = PromptEmbeddings.cat([cond.row(0), cond.row(1)])
    assert same.mask is None and same.prompts == ["a red cube"] * 2      # equal lengths: no mask, as diffusers
    uniq = cond.select([0, 2])
    for suffix in (".safetensors", ".pt"):
        uniq.save(tmp_path / f"cache{suffix}")
        back = PromptEmbeddings.load(tmp_path / f"cache{suffix}")
        assert back.pooled is None and back.prompts == uniq.prompts
        torch.testing.assert_close(back.prompt_embeds, uniq.prompt_embeds)
        assert torch.equal(back.mask, uniq.mask)
    torch.save({p: (uniq.row(k).prompt_embeds[0], None) for k, p in enumerate(uniq.prompts)}, tmp_path / "d.pt")
    back = PromptEmbeddings.load(tmp_path / "d.pt")
    assert torch.equal(back.mask, uniq.mask) and torch.equal(back.prompt_embeds, uniq.prompt_embeds)
    with pytest.raises(ValueError, match="takes no text mask"):
        velocity_adapter(tiny_sd3(), PromptEmbeddings(cond.prompt_embeds, torch.zeros(4, DP), None, cond.mask))
    with pytest.raises(ValueError, match="takes no pooled embeddings"):
        velocity_adapter(tiny_qwen(), embeds()[0])
    with pytest.raises(ValueError, match="tokens followed by padding"):
        PromptEmbeddings(cond.prompt_embeds[:1], None, None, torch.tensor([[True, False, True, True, True]])).row(0)


def test_loader_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; jagg never downloads"):
        check_model_dir(tmp_path / "nope", "sd3")
    (tmp_path / "file.safetensors").write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match="diffusers model directory"):
        check_model_dir(tmp_path / "file.safetensors", "sd3")
    with pytest.raises(FileNotFoundError, match="no model_index.json"):
        check_model_dir(tmp_path, "sd3")
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(FileNotFoundError, match="no transformer/ subfolder"):
        check_model_dir(tmp_path, "sd3")
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="set pipeline.family: 'flux'"):
        check_model_dir(tmp_path, "sd3")
    with pytest.raises(ValueError, match="multiple of 16"):
        PipelineConfig(resolution=500)
    (tmp_path / "bad.yaml").write_text("pipeline:\n  family: sd3\n  cfg_scal: 2.0\n")
    with pytest.raises(ValueError, match="pipeline.cfg_scal'; did you mean 'cfg_scale'"):
        load_pipeline_config(tmp_path / "bad.yaml")


def test_load_model_from_a_local_directory(tmp_path, capsys):
    """A tiny SD3 pipeline saved to disk: load with text encoders (encode_prompt), build a prompt cache, load without
    them from the cache, sample a rollout, decode it and compute the KL reference."""
    save_sd3_pipeline(tmp_path / "sd3")
    yaml_text = (f"pipeline:\n  family: sd3\n  path: {tmp_path / 'sd3'}\n  dtype: fp32\n  device: cpu\n"
                 "  resolution: 128\n  num_steps: 4\n  max_sequence_length: 8\n  lora: {rank: 2}\n"
                 "sample: {group_size: 4}\n")
    (tmp_path / "cfg.yaml").write_text(yaml_text)
    cfg = load_pipeline_config(tmp_path / "cfg.yaml")
    assert cfg.lora.rank == 2 and cfg.cfg_scale == 4.5
    prompts = ["a red cube", "a red cube", "a blue ball", "a blue ball"]

    model = load_model(cfg)                               # text encoders loaded: embeds with encode_prompt
    assert model.latent_shape == (C, H, W) and model.shift == default_shift("sd3", 128, {"shift": 3.0}) == 3.0
    e = model.embeddings(prompts)
    assert e.prompt_embeds.shape == (4, 77 + 8, D) and not torch.allclose(e.pooled[0], e.pooled[2])
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    cache_cli = ["cache", "--config", str(tmp_path / "cfg.yaml"), "--prompts", str(tmp_path / "prompts.txt")]
    assert pipeline.main(cache_cli + ["--out", str(tmp_path / "cache.safetensors")]) == 0     # python -m ... cache
    assert pipeline.main(cache_cli + ["--out", str(tmp_path / "cache.safetensors")]) == 2     # never replaced unasked
    assert "cache.safetensors exists; pass --overwrite" in capsys.readouterr().err
    assert pipeline.main(cache_cli + ["--out", str(tmp_path / "cache.npz")]) == 2
    assert "the file name must end in one of .safetensors, .pt, .pth" in capsys.readouterr().err
    assert pipeline.main(["cache", "--config", str(tmp_path / "cfg.yaml"), "--prompts", str(tmp_path / "none.txt"),
                          "--out", str(tmp_path / "c.pt")]) == 2
    assert "--prompts" in (err := capsys.readouterr().err) and "none.txt' does not exist" in err

    import dataclasses
    cached = load_model(dataclasses.replace(cfg, prompt_cache=str(tmp_path / "cache.safetensors")))
    assert cached.pipe.text_encoder is None                # not loaded at all
    torch.testing.assert_close(cached.embeddings(prompts).pooled, e.pooled)
    with pytest.raises(KeyError, match="not in the prompt-embedding cache"):
        cached.embeddings(["an unseen prompt"])
    v = cached.velocity(prompts)
    traj = jagg.sample_trajectories(v, cached.noise(4, torch.Generator().manual_seed(0)), cached.sigmas(), cfg.eta)
    images = cached.decode(traj.latents[:, -1])
    assert images.shape == (4, 128, 128, 3) and images.dtype == np.uint8
    ref = jagg.reference_velocities(cached.reference(v), traj)
    torch.testing.assert_close(ref[:, 0], traj.velocities[:, 0], rtol=1e-4, atol=1e-5)   # B = 0 at init
    cached.save_adapter(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "pytorch_lora_weights.safetensors").is_file()


def test_flux_model_from_directory_with_prompt_cache(tmp_path):
    pipe = diffusers.FluxPipeline(transformer=tiny_flux(), scheduler=FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True), vae=tiny_vae(), text_encoder=None, tokenizer=None, text_encoder_2=None,
        tokenizer_2=None)
    pipe.save_pretrained(tmp_path / "flux")
    cond, _ = embeds(prompts=("a red cube", ""))
    cond.select([0, 2]).save(tmp_path / "cache.pt")
    cfg = PipelineConfig(family="flux", path=str(tmp_path / "flux"), dtype="fp32", device="cpu", resolution=128,
                         num_steps=4, cfg_scale=1.0, guidance_embed=3.5, eta=0.9,
                         prompt_cache=str(tmp_path / "cache.pt"),
                         lora=LoraSettings(enabled=False), keep_reference=True, gradient_checkpointing=True)
    model = load_model(cfg)
    assert model.latent_shape == (C, H, W) and abs(model.shift - np.exp(0.5 + 0.65 * (64 - 256) / 3840)) < 1e-9
    assert all(p.requires_grad for p in model.transformer.parameters())        # full fine-tuning
    v = model.velocity(["a red cube"] * 2)
    traj = jagg.sample_trajectories(v, model.noise(2), model.sigmas(), cfg.eta)
    stats = jagg.policy_gradient(v, traj, torch.tensor([1.0, -1.0]), jagg.EstimatorConfig(mode="exact", micro_batch=2))
    assert stats.backward_items == 2 * 4
    assert decode_latents(model.vae, traj.latents[:, -1]).shape == (2, 128, 128, 3)
    assert isinstance(model, RealModel) and model.reference(v) is not None


@pytest.mark.parametrize("name, family, rank", [("sd35_medium", "sd3", 32), ("flux_dev", "flux", 64),
                                                ("qwen_image", "qwen_image", 64)])
def test_shipped_yaml_configs_load(name, family, rank, tmp_path):
    """configs/<name>.yaml: the pipeline section loads, the trainer sections use the trainer's keys, the reward
    server section builds a client (or the reward section names a registry reward), and the placeholder model path
    fails with the download hint."""
    import yaml

    from jagg.trainers.diffusers_config import DiffusersSampleSection
    from jagg.trainers.sections import GRPOSection, OptimSection
    from jagg.infra.config_loader import from_dict
    from jagg.rewards import RewardClient

    path = Path(__file__).resolve().parents[1] / "configs" / f"{name}.yaml"
    cfg = load_pipeline_config(path)
    assert cfg.family == family and cfg.lora.resolved(family)[0] == rank
    assert not cfg.detach_uncond and not cfg.velocity_config().detach_uncond   # Flow-GRPO: both CFG branches
    assert set(cfg.lora.resolved(family)[2]) == set(LoraSettings().resolved(family)[2])   # = Flow-GRPO's list
    data = yaml.safe_load(path.read_text())
    (tmp_path / "prompts.txt").write_text("a red cube\n")
    data["sample"]["prompts_file"] = str(tmp_path / "prompts.txt")      # the shipped configs leave it to the user
    for section, cls in (("sample", DiffusersSampleSection), ("estimator", jagg.EstimatorConfig),
                         ("optim", OptimSection), ("grpo", GRPOSection)):
        from_dict(cls, data[section], section)
    if "reward_server" in data:
        RewardClient(**data["reward_server"])
    else:
        from jagg.rewards.registry import parse_spec, registered_name
        assert registered_name(data["reward"]["name"]) and parse_spec(data["reward"]["name"])[1]["path"]
    if not Path(cfg.path).exists():
        with pytest.raises(FileNotFoundError, match="never downloads weights"):
            load_model(cfg)


@pytest.mark.parametrize("fp32_params", [True, False])
def test_full_finetune_master_weights(fp32_params):
    """Full fine-tuning of a bf16 transformer: fp32_params gives fp32 master weights (AdamW updates below bf16's
    resolution are kept) while the KL reference copy stays bf16; without it the weights stay bf16."""
    cfg = PipelineConfig(family="sd3", path="unused", dtype="bf16", device="cpu", resolution=128, num_steps=2,
                         autocast="bf16", keep_reference=True,
                         lora=LoraSettings(enabled=False, fp32_params=fp32_params))
    model = RealModel(cfg, tiny_sd3().to(torch.bfloat16))
    want = torch.float32 if fp32_params else torch.bfloat16
    assert model.params and all(p.dtype == want and p.requires_grad for p in model.params)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in model.reference_model.parameters())
    p = model.params[0]
    before = p.detach().clone()
    with torch.no_grad():
        p.add_(1e-3 * before)       # a relative step of 1e-3: below half of bf16's resolution (2^-8)
    assert (p != before).any() == fp32_params
