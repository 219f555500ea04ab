"""Exact vs JAGG training-step time and peak memory on full-size SD3.5-Medium, FLUX.1-dev, Qwen-Image and Wan 2.1 T2V
1.3B transformers.

Random weights built from the published transformer configs (nothing is downloaded), bf16, Flow-GRPO's LoRA
(SD3.5: rank 32 on the attention projections; FLUX and Qwen-Image: rank 64 plus the MLPs; adapters in bf16 too, or
fp32 under bf16 autocast with ``--autocast``), Flow-GRPO's guidance (SD3.5: CFG 4.5 with both branches through the
network with grad, one batched forward, as its ``train.cfg = True``; ``--detach-uncond`` measures jagg's cheaper
variant, whose gradient differs: the unconditional branch a separate no-grad forward; FLUX.1-dev: embedded guidance
3.5, no CFG); Qwen-Image as the JAGG authors train it (no CFG, a static shift of 3; configs/qwen_image.yaml), 64 text
tokens; Wan 2.1 T2V 1.3B (``--models wan_1_3b``, not in the default list) as Flow-GRPO trains it (rank-32 LoRA on the
attention projections, CFG 4.5 with both branches with grad, 512 UMT5 tokens) on 33-frame videos (9 latent frames)
whose height is the resolution and whose width is 416/240 of it (Flow-GRPO: 240 x 416).
For each model and resolution one rollout of ``--samples`` trajectories x ``--steps`` steps (all trained) is
sampled with the model itself, then :func:`jagg.policy_gradient` computes the gradient of one update in ``exact``
mode and in ``jagg`` mode for every window and intermediate, all with the same ``--micro-batch``. Every
configuration runs once to warm up, then ``--repeats`` times in alternating (rotated) order; the table reports the
median seconds, the speed-up over exact, docs/design.md §3's cost-model limit (``B = 2F``: fresh ``3W/(W+4)``, interp
``W/2``; CFG's unconditional rows are not in it) and the peak GPU memory of the call. Before the calls, per model and
resolution, one network branch's forward (with and without grad) and backward are timed on a micro-batch of rows: the
JSON's ``costs`` records, whose ``b_over_f`` (backward / forward) ``jagg bench meter`` and ``jagg bench quality``
put into their projected cost structure with ``--gpu-bench-json``.

    python benchmarks/gpu_bench.py                       # one H200: < 5 minutes (a time budget guards it)
    python benchmarks/gpu_bench.py --models qwen_image --resolutions 512,1024    # Qwen-Image (20B) alone
    python benchmarks/gpu_bench.py --models wan_1_3b --resolutions 240,480       # Wan 2.1 1.3B, 33 frames
    python benchmarks/gpu_bench.py --scaled-down         # tiny configs on the CPU, seconds (used by the tests)
    python benchmarks/gpu_bench.py --small --models sd35m --resolutions 512 [--detach-uncond]   # CPU, ~1 min
    torchrun --nproc_per_node 8 benchmarks/gpu_bench.py --sharded --models flux,qwen_image --resolutions 512
    python benchmarks/gpu_bench.py --memory-table        # per-GPU memory of full fine-tuning, computed

``--sharded`` is full fine-tuning as ``jagg train`` runs it with ``distributed.strategy: fsdp``: the transformer is
sharded by its FSDP engine (:mod:`jagg.infra.engine`: ``fully_shard`` per block, fp32 master weights computing in bf16,
activation checkpointing per block) over the processes of the launch (one process: a process group of one), and each
timed update is the gradient and the AdamW step; the JSON rows add the elements of parameters and AdamW state this
process stores and the per-GPU memory :func:`sharded_memory` computes for the launch's process count.
``--memory-table`` prints that computation for SD3.5-Medium, FLUX.1-dev and Qwen-Image from their parameter counts
(the published configs built on the meta device), the table of docs/real_models.md.

Whatever does not fit in ``--time-budget`` seconds is reported as skipped, never silently dropped.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import jagg
from jagg.cost import cost_limit
from jagg.bench.speed_command import Subject, measure_costs
from jagg.integrations import LoraSettings, PromptEmbeddings, VelocityConfig, add_lora, velocity_adapter

# -- the published transformer configs (diffusers config.json of the model repos) ------------------------------

SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                   num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                   pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                   dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
# QwenImageTransformer2DModel's defaults, which are Qwen/Qwen-Image's transformer/config.json (20.4B parameters)
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers' transformer/config.json (1.4B parameters)
WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
# text tokens as Flow-GRPO encodes them (max_sequence_length 128): SD3 77 CLIP + 128 T5; FLUX 128 T5; Qwen-Image's
# prompts keep their own length (a short prompt and QwenImagePipeline's template suffix: 64 Qwen2.5-VL tokens here)
FULL = {"sd35m": dict(cls="SD3Transformer2DModel", config=SD35_MEDIUM, text_len=77 + 128, pooled=2048),
        "flux": dict(cls="FluxTransformer2DModel", config=FLUX_DEV, text_len=128, pooled=768),
        "qwen_image": dict(cls="QwenImageTransformer2DModel", config=QWEN_IMAGE, text_len=64, pooled=None),
        "wan_1_3b": dict(cls="WanTransformer3DModel", config=WAN_1_3B, text_len=512, pooled=None, frames=9)}
TINY = {"sd35m": dict(cls="SD3Transformer2DModel", text_len=8, pooled=8, config=dict(
            sample_size=16, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=2,
            joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8, out_channels=16,
            pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm")),
        "flux": dict(cls="FluxTransformer2DModel", text_len=8, pooled=8, config=dict(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8, guidance_embeds=True,
            axes_dims_rope=(2, 2, 4))),
        "qwen_image": dict(cls="QwenImageTransformer2DModel", text_len=8, pooled=None, config=dict(
            patch_size=2, in_channels=64, out_channels=16, num_layers=1, attention_head_dim=8, num_attention_heads=2,
            joint_attention_dim=16, axes_dims_rope=(2, 2, 4))),
        "wan_1_3b": dict(cls="WanTransformer3DModel", text_len=8, pooled=None, frames=2, config=dict(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=16, out_channels=16,
            text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32))}
# --small: 4-block models of width 128 on 32x32 latents at 512 px: the network, not Python, dominates on a CPU
SMALL = {"sd35m": dict(cls="SD3Transformer2DModel", text_len=16, pooled=32, config=dict(
             sample_size=32, patch_size=2, in_channels=16, num_layers=4, attention_head_dim=32, num_attention_heads=4,
             joint_attention_dim=64, caption_projection_dim=128, pooled_projection_dim=32, out_channels=16,
             pos_embed_max_size=32, dual_attention_layers=(0,), qk_norm="rms_norm")),
         "flux": dict(cls="FluxTransformer2DModel", text_len=16, pooled=32, config=dict(
             patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=32,
             num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=True,
             axes_dims_rope=(8, 12, 12))),
         "qwen_image": dict(cls="QwenImageTransformer2DModel", text_len=16, pooled=None, config=dict(
             patch_size=2, in_channels=64, out_channels=16, num_layers=4, attention_head_dim=32,
             num_attention_heads=4, joint_attention_dim=64, axes_dims_rope=(8, 12, 12))),
         "wan_1_3b": dict(cls="WanTransformer3DModel", text_len=16, pooled=None, frames=3, config=dict(
             patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=16, out_channels=16,
             text_dim=64, freq_dim=64, ffn_dim=256, num_layers=4, rope_max_seq_len=256))}
FAMILY = {"sd35m": "sd3", "flux": "flux", "qwen_image": "qwen_image", "wan_1_3b": "wan"}
GUIDANCE = {"sd35m": VelocityConfig(cfg_scale=4.5), "flux": VelocityConfig(guidance_embed=3.5),
            "qwen_image": VelocityConfig(), "wan_1_3b": VelocityConfig(cfg_scale=4.5)}
SHIFT = {"sd35m": lambda res: 3.0, "flux": lambda res: float(torch.exp(torch.tensor(
    0.5 + 0.65 * ((res // 16) ** 2 - 256) / 3840))), "qwen_image": lambda res: 3.0,
    "wan_1_3b": lambda res: 3.0}                # Wan 2.1's flow_shift (3 for 480p and below)


def latent_shape(spec: dict, lat: int) -> tuple[int, ...]:
    """One sample's latents: ``(16, lat, lat)``; a video model's ``(16, frames, lat, width)`` with Flow-GRPO's 240 x
    416 aspect (the width rounded to an even number of latents)."""
    if "frames" not in spec:
        return (16, lat, lat)
    return (16, spec["frames"], lat, max(2, round(lat * 416 / 240 / 2) * 2))


@dataclass
class BenchConfig:
    models: list[str] = field(default_factory=lambda: ["sd35m", "flux", "qwen_image"])
    resolutions: list[int] = field(default_factory=lambda: [512, 1024])
    windows: list[int] = field(default_factory=lambda: [2, 4, 8])
    intermediates: list[str] = field(default_factory=lambda: ["fresh", "interp"])
    samples: int = 1
    steps: int = 8
    micro_batch: int = 2
    repeats: int = 2
    time_budget: float = 270.0
    lora: bool = True
    gradient_checkpointing: bool = False
    autocast: bool = False
    detach_uncond: bool = False
    clock: str = "wall"
    dtype: str = "bf16"
    device: str = "auto"
    scaled_down: bool = False
    small: bool = False
    sharded: bool = False
    seed: int = 0

    def __post_init__(self):
        bad = [m for m in self.models if m not in FULL]
        if bad:
            raise ValueError(f"unknown models {bad}; choose from {list(FULL)}")
        if any(r % 16 or r < 16 for r in self.resolutions):
            raise ValueError(f"resolutions must be positive multiples of 16; got {self.resolutions}")
        if any(w < 1 for w in self.windows) or any(i not in ("fresh", "interp") for i in self.intermediates):
            raise ValueError("windows must be >= 1 and intermediates in {fresh, interp}")
        for name in ("samples", "steps", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1")
        if self.clock not in ("wall", "process"):
            raise ValueError(f"--clock must be 'wall' or 'process'; got {self.clock!r}")
        if self.scaled_down and self.small:
            raise ValueError("choose one of --scaled-down (tiny smoke run) and --small (CPU measurements)")
        if self.micro_batch < 2:
            raise ValueError("--micro-batch must be >= 2 (a JAGG group's two endpoints go through together)")


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build_transformer(name: str, cfg: BenchConfig, dev: torch.device, dtype: torch.dtype):
    """The transformer with random weights, created directly on ``dev`` in ``dtype`` (no fp32 copy on the host)."""
    import diffusers

    spec = (TINY if cfg.scaled_down else SMALL if cfg.small else FULL)[name]
    old_dtype = torch.get_default_dtype()
    torch.manual_seed(cfg.seed)
    try:
        torch.set_default_dtype(dtype)
        with torch.device(dev):
            model = getattr(diffusers, spec["cls"])(**spec["config"])
    finally:
        torch.set_default_dtype(old_dtype)
    model.to(dev, dtype)
    if cfg.lora:
        add_lora(model, LoraSettings(fp32_params=cfg.autocast), FAMILY[name])
    else:
        model.requires_grad_(True)
    if cfg.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    return model, spec


def parameter_count(name: str) -> int:
    """Parameters of the full-size transformer ``name`` (its published config built on the meta device)."""
    import diffusers

    with torch.device("meta"):
        model = getattr(diffusers, FULL[name]["cls"])(**FULL[name]["config"])
    return sum(p.numel() for p in model.parameters())


def sharded_memory(n_params: int, processes: int, reference: bool = False) -> dict:
    """GiB per GPU (computed from the parameter count, not measured) of full fine-tuning with jagg's FSDP engine over
    ``processes`` GPUs: fp32 master weights, fp32 gradients and AdamW's two fp32 moments, each a 1/``processes``
    shard, and with ``reference`` the frozen KL reference copy in bf16, sharded too. Activations, one gathered
    block's bf16 weights and gradients, and the VAE and text encoders come on top. One process: DDP's (replicated)."""
    gib = n_params / processes / 2**30
    parts = dict(weights=4 * gib, gradients=4 * gib, adamw=8 * gib, reference=2 * gib if reference else 0.0)
    return dict(parts, total=sum(parts.values()))


def memory_table(counts: dict[str, int], processes=(1, 2, 4, 8)) -> str:
    """The Markdown table of :func:`sharded_memory` (with and without the KL reference) for ``counts`` (name ->
    parameters), the one in docs/real_models.md."""
    names = {"sd35m": "SD3.5-Medium", "flux": "FLUX.1-dev", "qwen_image": "Qwen-Image"}
    lines = ["| transformer | parameters | " + " | ".join(f"{p} GPU{'s' * (p > 1)}" for p in processes) + " |",
             "|---|---|" + "---|" * len(processes)]
    for name, n in counts.items():
        cells = [f"{sharded_memory(n, p)['total']:.0f} ({sharded_memory(n, p, True)['total']:.0f})" for p in processes]
        lines.append(f"| {names.get(name, name)} | {n / 1e9:.2f}B | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _group(dev: torch.device) -> tuple[int, int, bool]:
    """``(rank, world, created)``: the launch's process group (torchrun), or a group of this process alone."""
    import tempfile

    import torch.distributed as dist

    from jagg.infra.distributed import init_process_group_from_env

    rank, world = init_process_group_from_env()
    if dist.is_initialized():
        return rank, world, False
    store = Path(tempfile.mkdtemp()) / "rendezvous"
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"file://{store}", rank=0,
                            world_size=1)
    return 0, 1, True


def bench_sharded(name: str, cfg: BenchConfig, dev: torch.device, dtype: torch.dtype, t_start: float, rows: list,
                  costs: list) -> None:
    """Full fine-tuning of ``name`` sharded by jagg train's FSDP engine over the process group (module docstring): per
    resolution one rollout, then for each configuration the timed update (gradient, clipping, AdamW step)."""
    import torch.distributed as dist

    from jagg.infra.engine import EngineSettings, make_engine
    from jagg.integrations import PipelineConfig
    from jagg.integrations.policy import Policy

    rank, world = dist.get_rank(), dist.get_world_size()
    model, spec = build_transformer(name, dataclasses.replace(cfg, lora=False, gradient_checkpointing=False),
                                    torch.device("cpu"), dtype)           # sharded on the host, then moved
    config = PipelineConfig(family=FAMILY[name], dtype=cfg.dtype, device=str(dev), resolution=cfg.resolutions[0],
                            gradient_checkpointing=True, lora={"enabled": False, "fp32_params": True})
    policy = Policy(config, model, place=False)
    n_params = sum(p.numel() for p in policy.params)
    engine = make_engine(EngineSettings("fsdp", param_dtype="bf16" if dtype == torch.bfloat16 else None), rank, world,
                         dev)
    engine.wrap(policy)
    opt = torch.optim.AdamW(policy.params, lr=1e-7)
    g = torch.Generator().manual_seed(cfg.seed)
    width = spec["config"].get("joint_attention_dim", spec["config"].get("text_dim"))
    cond, uncond = (PromptEmbeddings(torch.randn(1, spec["text_len"], width, generator=g),
                                     None if spec["pooled"] is None else torch.randn(1, spec["pooled"], generator=g))
                    .to(dev) for _ in range(2))
    v = velocity_adapter(policy.transformer, cond.select([0] * cfg.samples), uncond, GUIDANCE[name], FAMILY[name])
    local = sum(p.to_local().numel() for p in policy.params)
    for res in cfg.resolutions:
        lat = res // (64 if cfg.scaled_down else 16 if cfg.small else 8)
        key = dict(model=name, resolution=res, params=n_params, trainable=n_params, processes=world,
                   param_local=local, computed_gb=sharded_memory(n_params, world)["total"])
        noise = torch.randn(cfg.samples, *latent_shape(spec, lat), generator=g).to(dev)
        with torch.no_grad(), engine.region():
            traj = jagg.sample_trajectories(v, noise, jagg.flow_sigmas(cfg.steps, shift=SHIFT[name](res)), 0.7,
                                            generator=torch.Generator(dev).manual_seed(1), micro_batch=cfg.micro_batch)
        adv = torch.linspace(-1, 1, cfg.samples, device=dev) if cfg.samples > 1 else torch.ones(1, device=dev)
        for c in run_configs(cfg):
            if time.perf_counter() - t_start > cfg.time_budget:
                rows.append(dict(key, mode=c[0], window=c[1], intermediate=c[2], status="skipped (time budget)"))
                continue
            times, info = [], {}
            for _ in range(cfg.repeats + 1):                           # the first: warm-up
                dt, info = _sharded_update(engine, policy, opt, v, traj, adv, c, cfg, dev)
                times.append(dt)
            adam = sum(t.to_local().numel() for st in opt.state.values() for k, t in st.items() if k != "step")
            st = info["stats"]
            rows.append(dict(key, mode=c[0], window=c[1], intermediate=c[2], status="ok",
                             seconds=statistics.median(times[1:]), times=times[1:], peak_gb=info["peak_gb"],
                             adam_local=adam, backward_items=st.backward_items,
                             forward_nograd_items=st.forward_nograd_items, forward_calls=st.forward_calls))
        exact = next((r["seconds"] for r in rows if r["model"] == name and r["resolution"] == res
                      and r["mode"] == "exact" and "seconds" in r), float("nan"))
        for r in rows:
            if r["model"] == name and r["resolution"] == res and "seconds" in r:
                r["speedup"] = exact / r["seconds"]
                r["cost_limit"] = 1.0 if r["mode"] == "exact" or r["window"] <= 2 else cost_limit(
                    r["window"], r["intermediate"], steps=cfg.steps)
        del traj
    del model, policy, v, opt


def _sharded_update(engine, policy, opt, v, traj, adv, c: tuple, cfg: BenchConfig, dev: torch.device):
    """One optimizer update of configuration ``c`` on the sharded model: seconds, statistics and peak GiB."""
    mode, w, inter = c
    est = jagg.EstimatorConfig(mode=mode, window=max(w, 1), intermediate="interp" if inter == "-" else inter,
                               micro_batch=cfg.micro_batch, clip_range=1e-4, correction_p=0.0)
    opt.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    _sync(dev)
    t0 = time.perf_counter()
    with engine.update() as backward_context:
        stats = jagg.policy_gradient(v, traj, adv, est, backward_context=backward_context)
    torch.nn.utils.clip_grad_norm_(policy.params, 1.0)
    opt.step()
    _sync(dev)
    return time.perf_counter() - t0, dict(stats=stats, peak_gb=torch.cuda.max_memory_allocated(dev) / 2**30
                                          if dev.type == "cuda" else float("nan"))


def run_configs(cfg: BenchConfig) -> list[tuple[str, int, str]]:
    out = [("exact", 1, "-")]
    for w in cfg.windows:
        if w <= 2:                                     # groups of <= 2 steps: fresh == interp == exact math
            out.append(("jagg", w, "-"))
        else:
            out += [("jagg", w, i) for i in cfg.intermediates]
    return out


def time_call(model, v, traj, adv, c: tuple, cfg: BenchConfig, dev: torch.device) -> tuple[float, dict]:
    """Seconds and stats of one ``jagg.policy_gradient`` call of configuration ``c = (mode, window, intermediate)``,
    device work included, and its peak memory (GiB, CUDA only)."""
    mode, w, inter = c
    est = jagg.EstimatorConfig(mode=mode, window=max(w, 1), intermediate="interp" if inter == "-" else inter,
                               micro_batch=cfg.micro_batch, clip_range=1e-4, correction_p=0.0)   # plain layouts
    model.zero_grad(set_to_none=True)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    clock = time.process_time if cfg.clock == "process" else time.perf_counter
    _sync(dev)
    t0 = clock()
    stats = jagg.policy_gradient(v, traj, adv, est)
    _sync(dev)
    dt = clock() - t0
    return dt, dict(stats=stats, peak_gb=torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else float("nan"))


def network_costs(name: str, res: int, model, cond, traj, adv, cfg: BenchConfig, dev: torch.device) -> dict:
    """Seconds of one network branch's forward with and without grad and of its backward, on a micro-batch of the
    trajectory's rows (:func:`jagg.bench.speed_command.measure_costs`), and ``b_over_f`` = backward / forward with grad: the
    B/F that ``jagg bench meter --gpu-bench-json`` puts into its cost structure. One branch: SD3.5 without CFG
    (Flow-GRPO runs both branches as one batch, each with its own backward)."""
    one = velocity_adapter(model, cond.select([0] * cfg.samples), None,
                           dataclasses.replace(GUIDANCE[name], cfg_scale=1.0), FAMILY[name])
    costs = measure_costs(Subject(name, model, one, traj, adv), cfg.micro_batch, cfg.repeats, dev)
    return dict(model=name, resolution=res, **costs, b_over_f=costs["backward_s"] / costs["f_grad_s"])


def bench_model(name: str, cfg: BenchConfig, dev: torch.device, dtype: torch.dtype, t_start: float, rows: list,
                costs: list):
    model, spec = build_transformer(name, cfg, dev, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    g = torch.Generator().manual_seed(cfg.seed)

    def text() -> PromptEmbeddings:                          # one random prompt (Qwen-Image has no pooled embedding)
        width = spec["config"].get("joint_attention_dim", spec["config"].get("text_dim"))
        return PromptEmbeddings(torch.randn(1, spec["text_len"], width, generator=g),
                                None if spec["pooled"] is None else torch.randn(1, spec["pooled"], generator=g)
                                ).to(dev, dtype)

    cond, uncond = text(), text()
    # --autocast: fp32 adapter weights on the bf16 base, run under bf16 autocast (mixed precision); default: all bf16
    vcfg = dataclasses.replace(GUIDANCE[name], autocast="bf16" if cfg.autocast and dtype == torch.bfloat16 else None,
                               detach_uncond=cfg.detach_uncond)
    v = velocity_adapter(model, cond.select([0] * cfg.samples), uncond, vcfg, FAMILY[name])
    for res in cfg.resolutions:
        lat = res // (64 if cfg.scaled_down else 16 if cfg.small else 8)    # 512 px: 8x8 / 32x32 / 64x64
        key = dict(model=name, resolution=res, params=n_params, trainable=n_train)
        if time.perf_counter() - t_start > cfg.time_budget:
            rows += [dict(key, mode=m, window=w, intermediate=i, status="skipped (time budget)")
                     for m, w, i in run_configs(cfg)]
            continue
        try:
            noise = torch.randn(cfg.samples, *latent_shape(spec, lat), generator=g).to(dev)
            sig = jagg.flow_sigmas(cfg.steps, shift=SHIFT[name](res))
            with torch.no_grad():
                traj = jagg.sample_trajectories(v, noise, sig, 0.7, generator=torch.Generator(dev).manual_seed(1),
                                                micro_batch=cfg.micro_batch)
        except torch.cuda.OutOfMemoryError:
            rows += [dict(key, mode=m, window=w, intermediate=i, status="OOM (sampling)")
                     for m, w, i in run_configs(cfg)]
            continue
        adv = torch.linspace(-1, 1, cfg.samples, device=dev) if cfg.samples > 1 else torch.ones(1, device=dev)
        try:
            costs.append(network_costs(name, res, model, cond, traj, adv, cfg, dev))
        except torch.cuda.OutOfMemoryError:
            costs.append(dict(model=name, resolution=res, status="OOM"))
            model.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
        configs = run_configs(cfg)
        times: dict = {c: [] for c in configs}
        info: dict = {}

        status: dict = {}
        for r in range(cfg.repeats + 1):                      # pass 0 = warm-up (discarded)
            order = configs[r % len(configs):] + configs[: r % len(configs)]
            for c in order:
                if c in status:
                    continue
                elapsed = time.perf_counter() - t_start
                guess = statistics.median(times[c]) if times[c] else 0.0
                if elapsed + guess > cfg.time_budget:
                    status.setdefault(c, "skipped (time budget)" if not times[c] else "partial (time budget)")
                    continue
                try:
                    dt, info[c] = time_call(model, v, traj, adv, c, cfg, dev)
                    times[c].append(dt)
                except torch.cuda.OutOfMemoryError:
                    status[c] = "OOM"
                    model.zero_grad(set_to_none=True)
                    gc.collect()
                    torch.cuda.empty_cache()
            if r == 0:
                for c in configs:
                    times[c] = times[c][:0]                     # drop the warm-up
        exact_t = statistics.median(times[configs[0]]) if times[configs[0]] else float("nan")
        for c in configs:
            mode, w, inter = c
            t = statistics.median(times[c]) if times[c] else float("nan")
            st = info[c]["stats"] if c in info else None
            rows.append(dict(
                key, mode=mode, window=w, intermediate=inter, status=status.get(c, "ok"), seconds=t,
                times=times[c], speedup=exact_t / t if times[c] and times[configs[0]] else float("nan"),
                cost_limit=1.0 if mode == "exact" or w <= 2 else cost_limit(w, inter, steps=cfg.steps),
                peak_gb=info[c]["peak_gb"] if c in info else float("nan"),
                backward_items=st.backward_items if st else None,
                forward_nograd_items=st.forward_nograd_items if st else None,
                forward_calls=st.forward_calls if st else None))
        del traj
    del model, v
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def table(rows: list[dict]) -> str:
    head = f"{'model':6} {'res':>5} {'mode':5} {'W':>2} {'inter':6} {'sec':>8} {'speedup':>7} {'limit':>5} " \
           f"{'peak GB':>7} {'bwd':>4} {'fwd0':>4}  status"
    lines = [head, "-" * len(head)]
    for r in rows:
        def f(x, fmt):
            return format(x, fmt) if isinstance(x, (int, float)) and x == x else "-"
        lines.append(f"{r['model']:6} {r['resolution']:>5} {r['mode']:5} {r['window']:>2} {r['intermediate']:6} "
                     f"{f(r.get('seconds'), '8.3f'):>8} {f(r.get('speedup'), '7.2f'):>7} "
                     f"{f(r.get('cost_limit'), '5.2f'):>5} {f(r.get('peak_gb'), '7.1f'):>7} "
                     f"{f(r.get('backward_items'), 'd'):>4} {f(r.get('forward_nograd_items'), 'd'):>4}  "
                     f"{r['status']}")
    return "\n".join(lines)


def _clean(x):
    """JSON-safe: NaN -> null, tuples -> lists, unknown objects -> str."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float):
        return None if x != x else x
    if isinstance(x, (int, str, bool)) or x is None:
        return x
    return str(x)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="sd35m,flux,qwen_image", help="comma list of sd35m, flux, qwen_image, "
                    "wan_1_3b (Wan 2.1 T2V 1.3B, 33 frames; e.g. --resolutions 240,480)")
    ap.add_argument("--resolutions", default=None, help="comma list of image sizes (default 512,1024; "
                    "scaled-down: 512,1024 mapped to 8x8 and 16x16 latents)")
    ap.add_argument("--windows", default="2,4,8")
    ap.add_argument("--intermediates", default="fresh,interp")
    ap.add_argument("--samples", type=int, default=1, help="trajectories in the batch")
    ap.add_argument("--steps", type=int, default=8, help="sampling steps, all trained")
    ap.add_argument("--micro-batch", type=int, default=2, help="rows per network call, every mode")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per configuration after one warm-up "
                    "(default 2; scaled-down 1)")
    ap.add_argument("--time-budget", type=float, default=270.0, help="seconds; later configurations are skipped")
    ap.add_argument("--full", action="store_true", help="full fine-tuning instead of Flow-GRPO's LoRA")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--autocast", action="store_true", help="fp32 LoRA weights + bf16 autocast (default: all bf16)")
    ap.add_argument("--detach-uncond", action="store_true", help="SD3.5: no gradient through CFG's unconditional "
                    "branch, run as a separate no-grad forward (jagg's cheaper variant; it changes the gradient). "
                    "Default: both branches with grad, as Flow-GRPO")
    ap.add_argument("--clock", default="wall", choices=["wall", "process"], help="time each call by the wall clock "
                    "(default) or by this process's CPU time ('process': for CPU runs with --threads 1 on a shared "
                    "machine, where other jobs inflate the wall clock)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's; scaled-down: 1, "
                    "tiny ops on a busy CPU are far slower with more threads)")
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="weights dtype (default bf16; "
                    "scaled-down fp32)")
    ap.add_argument("--scaled-down", action="store_true", help="tiny configs, fp32, CPU: a smoke run in seconds")
    ap.add_argument("--small", action="store_true", help="small configs (4 blocks, width 128, 32x32 latents at 512 "
                    "px), fp32, CPU: comparisons in about a minute, e.g. with and without --detach-uncond")
    ap.add_argument("--sharded", action="store_true", help="full fine-tuning sharded by jagg train's FSDP engine "
                    "over the processes of the launch (torchrun --nproc_per_node N; one process: a group of one), "
                    "each update with its AdamW step")
    ap.add_argument("--memory-table", action="store_true", help="print the per-GPU memory of full fine-tuning under "
                    "FSDP for SD3.5-Medium, FLUX.1-dev and Qwen-Image, computed from their parameter counts, and exit")
    ap.add_argument("--out", default="bench_gpu.json", help="JSON output path")
    a = ap.parse_args(argv)
    if a.memory_table:
        text = memory_table({name: parameter_count(name) for name in ("sd35m", "flux", "qwen_image")})
        print("GiB per GPU, computed from the parameter counts (not measured): fp32 master weights, gradients and "
              "AdamW moments, 1/N each; in parentheses with the bf16 KL reference copy, sharded too\n" + text)
        return {"memory_table": text}
    cfg = BenchConfig(models=a.models.split(","), windows=[int(x) for x in a.windows.split(",")],
                      resolutions=[int(x) for x in (a.resolutions or "512,1024").split(",")],
                      intermediates=a.intermediates.split(","), samples=a.samples, steps=a.steps,
                      micro_batch=a.micro_batch, repeats=a.repeats or (1 if a.scaled_down else 2),
                      small=a.small,
                      time_budget=a.time_budget, lora=not (a.full or a.sharded), sharded=a.sharded,
                      gradient_checkpointing=a.gradient_checkpointing,
                      autocast=a.autocast, detach_uncond=a.detach_uncond, clock=a.clock,
                      device=("cpu" if (a.scaled_down or a.small) and a.device == "auto" else a.device),
                      dtype=a.dtype or ("fp32" if a.scaled_down or a.small else "bf16"), scaled_down=a.scaled_down)
    dev = _device(cfg.device)
    threads = a.threads if a.threads is not None else (1 if cfg.scaled_down else 0)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run(cfg, dev, a.out)
    finally:
        torch.set_num_threads(old_threads)


def _run(cfg: BenchConfig, dev: torch.device, out: str) -> dict:
    if dev.type == "cpu" and not (cfg.scaled_down or cfg.small):
        print("warning: full-size models on the CPU will not finish; use a GPU or --scaled-down", file=sys.stderr)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg.dtype]
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    t_start = time.perf_counter()
    rows: list[dict] = []
    costs: list[dict] = []
    rank, created = 0, False
    if cfg.sharded:
        rank, _, created = _group(dev)
    try:
        for name in cfg.models:
            if time.perf_counter() - t_start > cfg.time_budget:
                rows += [dict(model=name, resolution=res, mode=m, window=w, intermediate=i,
                              status="skipped (time budget)") for res in cfg.resolutions for m, w, i in run_configs(cfg)]
                continue
            try:
                (bench_sharded if cfg.sharded else bench_model)(name, cfg, dev, dtype, t_start, rows, costs)
            except torch.cuda.OutOfMemoryError:
                rows += [dict(model=name, resolution=res, mode="-", window=0, intermediate="-", status="OOM (model)")
                         for res in cfg.resolutions]
                gc.collect()
                torch.cuda.empty_cache()
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()
    if rank:
        return dict(rows=rows)                               # the main process reports
    import diffusers

    result = dict(config=asdict(cfg), rows=rows, costs=costs, wall_seconds=time.perf_counter() - t_start,
                  env=dict(device=(torch.cuda.get_device_name(dev) if dev.type == "cuda"
                                   else platform.processor() or "cpu"),
                           torch=torch.__version__, diffusers=diffusers.__version__,
                           python=platform.python_version(), threads=torch.get_num_threads()))
    print(table(rows))
    for c in costs:
        if "b_over_f" in c:
            print(f"{c['model']} at {c['resolution']}: forward {c['f_grad_s'] * 1e3:.1f} ms with grad, "
                  f"{c['f_nograd_s'] * 1e3:.1f} ms without, backward {c['backward_s'] * 1e3:.1f} ms: B/F "
                  f"{c['b_over_f']:.2f} (one branch, {cfg.micro_batch} rows)")
    for r in rows:
        if r.get("processes") and r["mode"] == "exact" and "adam_local" in r:
            print(f"{r['model']} at {r['resolution']}, sharded over {r['processes']} process(es): {r['params']:,} "
                  f"weights, of which this process stores {r['param_local']:,}, and {r['adam_local']:,} AdamW "
                  f"elements; computed {r['computed_gb']:.3g} GiB per GPU for weights, gradients and AdamW")
    print(f"total {result['wall_seconds']:.1f} s; speedup = exact seconds / seconds (same micro-batch); limit = cost "
          "model with B = 2F; bwd = rows back-propagated, fwd0 = no-grad rows (fresh)"
          + ("; sharded: seconds of the whole update (gradient and AdamW step)" if cfg.sharded else ""))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(_clean(result), indent=1, allow_nan=False))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
