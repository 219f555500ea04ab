"""``jagg bench speed``: exact vs JAGG on the same model, batch, trajectory and micro-batch size.

For each model and each (knot layout, window, intermediate), :func:`jagg.policy_gradient` runs alternately in
``exact`` and ``jagg`` mode (exact, jagg, exact, jagg, ... after a warm-up of every mode), ``repeats`` times
each, on one stored trajectory; the same for every layout of window > 2 with interval subsampling
(``--interval-fracs``) and with unbiased JAGG's correction (``--corrections``, rates ``P``), each labelled in
``variant``, and for random timestep subsampling (``--subsample``). Reported per pair: the median seconds of each call (the training
phase: forward passes, loss head and backward), their ratio (the speed-up), the cost-model limit of docs/design.md §3
with ``B = 2F`` (expected rows for the random ones) and the limit computed from this model's measured
forward/backward times of one micro-batch, forward/backward row counts, and peak memory.

Models:
- ``tiny_dit``: the embedded TinyDiT (``builtin:tiny_dit``, or a random one if the asset is missing) through
  :class:`jagg.shapes.guided_velocity.GuidedVelocity` with classifier-free guidance;
- ``sd3``: a diffusers ``SD3Transformer2DModel`` from a small config with random weights, through the
  project's adapter ``jagg.integrations.velocity_adapter`` with the same guidance scheme (skipped with a
  message when diffusers is not installed);
- ``config`` (with ``--config``, added to the default models): the user's model at its real size, the trainer's
  own sampler of that config (:func:`jagg.bench.meter_command.make_sampler`: for a ``pipeline:`` section the diffusers
  pipeline's transformer with its LoRA or trainable weights, on ``pipeline.device``, its guidance as the trainer
  trains it). Its trajectory is the first ``--batch`` samples of one of the trainer's rollouts: the config's
  sampling steps and trained steps (``pipeline.num_steps``, ``sample.timestep_fraction``, ``sde_window``), not
  ``--steps``; ``--micro-batch`` and ``--repeats`` as for the others.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from ..arguments import config_arguments
from ..checks import check_count, number_arg
from ..estimator_config import INTERMEDIATES, KNOTS, EstimatorConfig
from ..estimator import GradientStats, policy_gradient
from ..schedule import flow_sigmas
from ..trainers.rollout import take
from ..trajectory import Trajectory, VelocityFn, sample_trajectories
from .common import (PeakMemory, json_if_asked, median, resolve_device, set_threads, table, timed)
from ..cost import estimator_limit

BUILT_IN_MODELS = ("tiny_dit", "sd3")
MODELS = BUILT_IN_MODELS + ("config",)            # config: the model of --config


@dataclass
class SD3Spec:
    """A small ``SD3Transformer2DModel`` (random weights) whose network dominates the step time."""

    layers: int = 4
    heads: int = 4                 # hidden size = heads * head_dim
    head_dim: int = 64
    latent_size: int = 32          # latents [C, latent_size, latent_size], patch 2 -> (latent_size / 2)^2 tokens
    channels: int = 16
    text_len: int = 32             # prompt-embedding tokens
    joint_dim: int = 256           # prompt-embedding width
    pooled_dim: int = 128

    def __post_init__(self):
        for k, v in asdict(self).items():
            setattr(self, k, check_count(v, f"sd3 {k}"))
        if self.latent_size % 2:
            raise ValueError(f"sd3 latent_size must be even (patch size 2); got {self.latent_size}")


@dataclass
class SpeedConfig:
    models: list[str] = field(default_factory=lambda: list(BUILT_IN_MODELS))
    windows: list[int] = field(default_factory=lambda: [2, 4, 8])
    knots: list[str] = field(default_factory=lambda: list(KNOTS))
    intermediates: list[str] = field(default_factory=lambda: ["interp", "fresh"])
    subsample: list[float] = field(default_factory=lambda: [0.5])     # mode="subsample" fractions timed too
    interval_fracs: list[float] = field(default_factory=lambda: [0.5])  # interval subsampling, each layout W > 2
    corrections: list[float] = field(default_factory=lambda: [0.25])  # correction_p rates, each layout W > 2
    batch: int = 4                 # trajectories B
    steps: int = 16                # sampling steps T, all trained
    micro_batch: int = 8           # rows per network call, the same in every mode
    repeats: int = 3               # timed calls of each mode per pair (medians)
    guidance_scale: float = 3.0
    shift: float = 3.0             # SD3's schedule shift
    eta: float = 0.7
    seed: int = 0
    device: str = "cpu"
    threads: int = 0
    tiny_checkpoint: str = "builtin:tiny_dit"
    sd3: SD3Spec = field(default_factory=SD3Spec)
    config: str | None = None      # a trainer YAML: the model "config" (its trainer's sampler)
    sets: list[str] = field(default_factory=list)     # its --set overrides

    def __post_init__(self):
        bad = [m for m in self.models if m not in MODELS]
        if bad or not self.models:
            raise ValueError(f"--models must be some of {MODELS}; got {self.models}")
        if "config" in self.models and self.config is None:
            raise ValueError("--models config times the model of --config; give --config PATH (a trainer YAML)")
        bad = [k for k in self.knots if k not in KNOTS]
        if bad or not self.knots:
            raise ValueError(f"--knots must be some of {KNOTS}; got {self.knots}")
        if not all(isinstance(f, (int, float)) and 0 < f <= 1 for f in self.subsample):
            raise ValueError(f"--subsample fractions must be in (0, 1]; got {self.subsample}")
        if not all(isinstance(f, (int, float)) and 0 < f <= 1 for f in self.interval_fracs):
            raise ValueError(f"--interval-fracs must be in (0, 1]; got {self.interval_fracs}")
        if not all(isinstance(p, (int, float)) and 0 < p <= 1 for p in self.corrections):
            raise ValueError(f"--corrections rates must be in (0, 1]; got {self.corrections}")
        bad = [i for i in self.intermediates if i not in INTERMEDIATES]
        if bad or not self.intermediates:
            raise ValueError(f"--intermediates must be some of {INTERMEDIATES}; got {self.intermediates}")
        if not self.windows or any(w < 2 for w in self.windows):
            raise ValueError(f"--windows must be integers >= 2; got {self.windows}")
        for name in ("batch", "steps", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1; got {getattr(self, name)}")
        if self.micro_batch < 2:
            raise ValueError(f"--micro-batch must be >= 2 (an interval's two knots go together); "
                             f"got {self.micro_batch}")
        if max(self.windows) > self.steps:
            raise ValueError(f"--steps ({self.steps}) must be >= the largest window ({max(self.windows)})")


QUICK = dict(batch=2, steps=8, micro_batch=4, repeats=2,
             sd3=SD3Spec(layers=2, heads=4, latent_size=16, text_len=16))


# ----------------------------------------------------------------------------- models


@dataclass
class Subject:
    """One model set up for timing: its velocity callable, a sampled trajectory and advantages."""

    name: str
    model: nn.Module
    velocity: VelocityFn
    traj: Trajectory
    adv: Tensor
    device: torch.device | None = None          # where the model runs, when not --device (a pipeline.device)
    guidance: float | None = None               # its guidance scale, when not --guidance-scale

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def _tiny_dit(cfg: SpeedConfig, device: torch.device, gen: torch.Generator):
    from ..shapes.weights import load_model
    from ..shapes.dit import DiTConfig, TinyDiT
    from ..shapes.guided_velocity import GuidedVelocity
    from ..shapes import tokenizer, train_prompts

    name = "tiny_dit"
    try:
        model = load_model(cfg.tiny_checkpoint)
    except FileNotFoundError:
        if cfg.tiny_checkpoint != "builtin:tiny_dit":
            raise
        print("speed: the shipped builtin:tiny_dit asset is missing; timing a randomly initialised TinyDiT "
              "(same architecture, same cost)")
        model, name = TinyDiT(DiTConfig(vocab_size=tokenizer.vocab_size)), "tiny_dit(random)"
    model = model.to(device).train()
    prompts = train_prompts()
    tokens = tokenizer.encode([prompts[i % len(prompts)] for i in range(cfg.batch)],
                              max_len=model.config.max_text_len).to(device)
    shape = (model.config.channels, model.config.image_size, model.config.image_size)
    return name, model, GuidedVelocity(model, tokens, cfg.guidance_scale), shape


def _sd3(cfg: SpeedConfig, device: torch.device, gen: torch.Generator):
    try:
        from diffusers import SD3Transformer2DModel

        from ..integrations import PromptEmbeddings, VelocityConfig, velocity_adapter
    except ImportError as e:
        print(f"speed: skipping model 'sd3': {e} (pip install 'jagg[diffusers]')")
        return None
    s = cfg.sd3
    model = SD3Transformer2DModel(
        sample_size=s.latent_size, patch_size=2, in_channels=s.channels, out_channels=s.channels,
        num_layers=s.layers, attention_head_dim=s.head_dim, num_attention_heads=s.heads,
        joint_attention_dim=s.joint_dim, caption_projection_dim=s.heads * s.head_dim,
        pooled_projection_dim=s.pooled_dim, pos_embed_max_size=max(s.latent_size // 2, 16),
    ).to(device).train()
    cond = PromptEmbeddings(torch.randn(cfg.batch, s.text_len, s.joint_dim, generator=gen, device=device),
                            torch.randn(cfg.batch, s.pooled_dim, generator=gen, device=device))
    uncond = PromptEmbeddings(torch.zeros(1, s.text_len, s.joint_dim, device=device),
                              torch.zeros(1, s.pooled_dim, device=device))
    # as the TinyDiT's GuidedVelocity (jagg's choice, not Flow-GRPO's): the unconditional branch a no-grad forward
    velocity = velocity_adapter(model, cond, uncond, VelocityConfig(cfg_scale=cfg.guidance_scale, detach_uncond=True))
    name = f"sd3(L{s.layers},d{s.heads * s.head_dim},{s.latent_size}x{s.latent_size})"
    return name, model, velocity, (s.channels, s.latent_size, s.latent_size)


def _from_config(cfg: SpeedConfig) -> Subject:
    """The model of ``--config`` as its trainer builds it (:func:`jagg.bench.meter_command.make_sampler`) and the first
    ``--batch`` samples of one of its rollouts, with random advantages."""
    from .meter_command import load_config, make_sampler

    train = load_config(cfg.config, cfg.sets)
    sampler = make_sampler(train)
    ro = sampler.sample()
    device = ro.traj.latents.device
    idx = torch.arange(min(cfg.batch, ro.traj.batch_size), device=device)
    cond = take(ro.conditioning, idx)
    network = getattr(sampler, "model", None) or sampler.policy.bare      # the shapes TinyDiT, or the transformer
    p = getattr(train, "pipeline", None)
    name = f"config({p.family},{p.resolution}px)" if p is not None else f"config({train.model.checkpoint})"
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    return Subject(name, network, sampler.velocity(cond), ro.traj.select(idx),
                   torch.randn(len(idx), generator=gen, device=device), device,
                   p.cfg_scale if p is not None else train.sample.guidance_scale)


def build_subject(model_name: str, cfg: SpeedConfig, device: torch.device) -> Subject | None:
    """Build the model and sample one on-policy trajectory batch (all steps trained) with it; ``config``: the model
    of ``--config`` and one of its trainer's rollouts (:func:`_from_config`)."""
    torch.manual_seed(cfg.seed)
    if model_name == "config":
        return _from_config(cfg)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    built = (_tiny_dit if model_name == "tiny_dit" else _sd3)(cfg, device, gen)
    if built is None:
        return None
    name, model, velocity, shape = built
    noise = torch.randn(cfg.batch, *shape, generator=gen, device=device)
    traj = sample_trajectories(velocity, noise, flow_sigmas(cfg.steps, cfg.shift), cfg.eta, generator=gen,
                               micro_batch=cfg.micro_batch)
    adv = torch.randn(cfg.batch, generator=gen, device=device)
    return Subject(name, model, velocity, traj, adv)


# ----------------------------------------------------------------------------- measurements


def gradient_call(s: Subject, est: EstimatorConfig, device: torch.device) -> tuple[float, GradientStats]:
    """Seconds of one ``policy_gradient`` call (grads zeroed first, outside the timing) and its stats."""
    s.model.zero_grad(set_to_none=True)
    return timed(lambda: policy_gradient(s.velocity, s.traj, s.adv, est), device)


def measure_costs(s: Subject, rows: int, repeats: int, device: torch.device) -> dict:
    """Median seconds of a forward with grad, a forward without grad and a backward of ``rows`` rows.

    Measured through the velocity callable (guidance included), on rows of the stored trajectory, with the
    backward of the scalar ``sum(v * G)`` as the estimator runs it.
    """
    T = s.traj.num_steps
    b = torch.arange(rows, device=device) % s.traj.batch_size
    k = torch.arange(rows, device=device) % T
    x, sig = s.traj.latents[b, k], s.traj.sigmas[k]
    signal = torch.randn_like(x)
    fg, fn, bw = [], [], []
    for _ in range(repeats + 1):                     # the first round is a warm-up
        s.model.zero_grad(set_to_none=True)
        with torch.no_grad():
            t_n, _ = timed(lambda: s.velocity(x, sig, b), device)
        t_g, v = timed(lambda: s.velocity(x, sig, b), device)
        t_b, _ = timed(lambda: (v * signal).sum().backward(), device)
        fn.append(t_n); fg.append(t_g); bw.append(t_b)
    s.model.zero_grad(set_to_none=True)
    return {"f_grad_s": median(fg[1:]), "f_nograd_s": median(fn[1:]), "backward_s": median(bw[1:])}


def _free_memory() -> None:
    """Return freed memory to the OS before a CPU RSS measurement (glibc only; harmless elsewhere)."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_memory(s: Subject, est: EstimatorConfig, device: torch.device) -> tuple[float | None, str]:
    """Peak extra memory (MiB) of one untimed ``policy_gradient`` call."""
    s.model.zero_grad(set_to_none=True)
    _free_memory()
    with PeakMemory(device) as pm:
        policy_gradient(s.velocity, s.traj, s.adv, est)
    s.model.zero_grad(set_to_none=True)
    return pm.mb, pm.kind


def bench_subject(s: Subject, cfg: SpeedConfig, device: torch.device) -> list[dict]:
    """All (window, intermediate) pairs of one model; one record per pair."""
    exact = EstimatorConfig(mode="exact", micro_batch=cfg.micro_batch)
    layouts = [(kn, w, i) for kn in cfg.knots for w in cfg.windows for i in cfg.intermediates]
    plain = dict(mode="jagg", micro_batch=cfg.micro_batch, correction_p=0.0)
    jaggs = {(kn, w, i, ""): EstimatorConfig(**plain, window=w, knots=kn, intermediate=i)   # the layouts themselves
             for kn, w, i in layouts}
    for kn, w, i in layouts:                      # interval subsampling and the corrections, on every layout W > 2
        if w <= 2:
            continue
        for f in cfg.interval_fracs:
            jaggs[(kn, w, i, f"interval_frac={f}")] = EstimatorConfig(**plain, window=w, knots=kn, intermediate=i,
                                                                       interval_frac=f)
        for p in cfg.corrections:
            jaggs[(kn, w, i, f"correction_p={p}")] = EstimatorConfig(**{**plain, "correction_p": p}, window=w,
                                                                      knots=kn, intermediate=i)
    # warm-up: every mode once
    _, st_exact = gradient_call(s, exact, device)
    for kn in cfg.knots:
        for i in cfg.intermediates:
            gradient_call(s, jaggs[(kn, max(cfg.windows), i, "")], device)
    costs = measure_costs(s, cfg.micro_batch, max(cfg.repeats, 3), device)
    fg, fn, bw = costs["f_grad_s"], costs["f_nograd_s"], costs["backward_s"]
    print(f"{s.name}: {s.params / 1e6:.2f}M parameters; one micro-batch of {cfg.micro_batch} rows: forward with "
          f"grad {fg * 1e3:.1f} ms, forward without grad {fn * 1e3:.1f} ms, backward {bw * 1e3:.1f} ms "
          f"(B/F_grad = {bw / fg:.2f})", flush=True)
    mem_exact, mem_kind = peak_memory(s, exact, device)

    K = int(s.traj.train_steps.numel())
    for f in cfg.subsample:                                 # random timestep subsampling: limit K / m, no inner rows
        jaggs[("subsample", f, "-", "")] = EstimatorConfig(mode="subsample", subsample_frac=f,
                                                           micro_batch=cfg.micro_batch)
    records = []
    for (kn, w, inter, variant), est in jaggs.items():
        t_exact, t_jagg = [], []
        st_jagg = None
        for _ in range(cfg.repeats):                       # interleaved: exact, jagg, exact, jagg, ...
            t, _ = gradient_call(s, exact, device)
            t_exact.append(t)
            t, st_jagg = gradient_call(s, est, device)
            t_jagg.append(t)
        mem_jagg, _ = peak_memory(s, est, device)
        # the network's share: rows through the network at the measured per-micro-batch costs
        net = lambda st: (st.forward_grad_items * (fg + bw) + st.forward_nograd_items * fn) / cfg.micro_batch
        ex, jg = median(t_exact), median(t_jagg)
        lim, lim_meas = estimator_limit(est, K), estimator_limit(est, K, fg, fn, bw)   # expected rows where random
        rec = {
            "model": s.name, "model_params": s.params, "device": str(device), "threads": torch.get_num_threads(),
            "batch": s.traj.batch_size, "steps": s.traj.num_steps, "trained_steps": K, "micro_batch": cfg.micro_batch,
            "guidance_scale": cfg.guidance_scale if s.guidance is None else s.guidance, "repeats": cfg.repeats,
            "mode": est.mode, "knots": kn, "intermediate": inter, "window": w, "variant": variant,
            "exact_s": ex, "jagg_s": jg, "speedup": ex / jg,
            "limit": lim, "limit_measured": lim_meas, "of_limit": (ex / jg) / lim_meas,
            "network_exact_s": net(st_exact), "network_jagg_s": net(st_jagg),
            "overhead_exact": ex / net(st_exact), "overhead_jagg": jg / net(st_jagg),
            "exact_times": t_exact, "jagg_times": t_jagg, **costs,
            "backward_items_exact": st_exact.backward_items, "backward_items_jagg": st_jagg.backward_items,
            "forward_grad_items_exact": st_exact.forward_grad_items,
            "forward_grad_items_jagg": st_jagg.forward_grad_items,
            "forward_nograd_items_exact": st_exact.forward_nograd_items,
            "forward_nograd_items_jagg": st_jagg.forward_nograd_items,
            "forward_calls_exact": st_exact.forward_calls, "forward_calls_jagg": st_jagg.forward_calls,
            "backward_calls_exact": st_exact.backward_calls, "backward_calls_jagg": st_jagg.backward_calls,
            "peak_mem_exact_mb": mem_exact, "peak_mem_jagg_mb": mem_jagg, "mem_kind": mem_kind,
        }
        records.append(rec)
        print(f"  {kn:<9} {'f' if kn == 'subsample' else 'W'}={w} {inter:<6} {variant:<17} exact {ex:.3f}s  jagg "
              f"{jg:.3f}s  speed-up {ex / jg:.2f}x  (limit {rec['limit']:.2f}, measured-cost limit {lim_meas:.2f})",
              flush=True)
    return records


COLUMNS = [
    ("model", "model", ""), ("knots", "knots", ""), ("window", "W", ""), ("intermediate", "interm.", ""),
    ("variant", "variant", ""),
    ("exact_s", "exact s", ".3f"), ("jagg_s", "jagg s", ".3f"), ("speedup", "speed-up", ".2f"),
    ("limit", "limit B=2F", ".2f"), ("limit_measured", "limit meas.", ".2f"), ("of_limit", "of limit", ".2f"),
    ("overhead_exact", "ovh ex", ".2f"), ("overhead_jagg", "ovh jg", ".2f"),
    ("backward_items_exact", "bwd ex", ""), ("backward_items_jagg", "bwd jg", ""),
    ("forward_nograd_items_jagg", "fwd-ng jg", ""),
    ("peak_mem_exact_mb", "mem ex MiB", ".0f"), ("peak_mem_jagg_mb", "mem jg MiB", ".0f"),
]


def run_speed(cfg: SpeedConfig) -> list[dict]:
    """Run the benchmark; returns one record per (model, window, intermediate)."""
    set_threads(cfg.threads)
    device = resolve_device(cfg.device)
    records = []
    for name in cfg.models:
        s = build_subject(name, cfg, device)
        if s is not None:
            records += bench_subject(s, cfg, s.device or device)
            del s
            gc.collect()
    return records


# ----------------------------------------------------------------------------- command line


def check_config_options(args: argparse.Namespace) -> None:
    """``--config`` and ``--set`` time the model ``config`` and nothing else: ``--set`` without ``--config``, or
    ``--config`` with ``--models`` that leave ``config`` out, would be ignored, and are refused; a ``--config`` that is
    timed is loaded (its checks run) before any model is."""
    if args.set and args.config is None:
        raise ValueError(f"--set {args.set[0]}: --set overrides keys of --config (the model config); give --config "
                         "PATH, a trainer YAML, with it")
    if args.config is not None and args.models is not None and "config" not in args.models:
        raise ValueError(f"--config {args.config}: --models {' '.join(args.models)} leaves out config, the model of "
                         "--config, which would not be timed; add config to --models, or drop --config")
    if args.config is not None:
        from .meter_command import load_config

        load_config(args.config, list(args.set or []))


def _run(args: argparse.Namespace) -> int:
    check_config_options(args)
    base = SpeedConfig(**QUICK) if args.quick else SpeedConfig()
    if args.config is not None and args.models is None:
        args.models = [*base.models, "config"]                   # --config: one more model beside the built-in ones
    sd3 = base.sd3
    sd3 = SD3Spec(**{**asdict(sd3), **{k: v for k, v in (("layers", args.sd3_layers), ("heads", args.sd3_heads),
                                                          ("latent_size", args.sd3_latent)) if v is not None}})
    over = {k: getattr(args, k) for k in ("models", "windows", "knots", "intermediates", "subsample", "interval_fracs",
                                          "corrections", "batch", "steps",
                                          "micro_batch",
                                          "repeats", "guidance_scale", "seed", "device", "threads",
                                          "tiny_checkpoint", "config") if getattr(args, k) is not None}
    over["sets"] = list(args.set or [])
    cfg = SpeedConfig(**{**asdict(base), **over, "sd3": sd3})
    records = run_speed(cfg)
    if not records:
        raise ValueError("no model could be benchmarked (see the messages above)")
    print()
    print(table(records, COLUMNS))
    print(f"\nmemory: {records[0]['mem_kind']} (peak above the start of the call; CPU RSS is approximate)")
    json_if_asked(args.json, records)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "speed", help="time exact vs JAGG (knot layouts x windows x fresh/interp) against the cost model",
        description="exact against JAGG on the same model, batch, trajectory and micro-batch size: the median seconds "
                    "of each mode's training phase, the speed-up, the cost model's limit (and the limit from this "
                    "model's measured forward and backward times), rows and peak memory, per knot layout, window "
                    "and intermediate mode.",
        epilog="The models, what is timed and the cost model: docs/benchmarks.md#jagg-bench-speed.")
    d = SpeedConfig()
    p.add_argument("--quick", action="store_true", help="tiny settings, about a minute on 2 cores")
    p.add_argument("--models", nargs="+", choices=MODELS, metavar="MODEL",
                   help=f"of {', '.join(MODELS)} [default: {' '.join(d.models)}, and config with --config]")
    config_arguments(p, "also time its model at its real size (models: config)", "pipeline.path=/models/sd35",
                     main_job=False)
    p.add_argument("--windows", nargs="+", type=number_arg(int, 2), metavar="W",
                   help=f"JAGG windows [default: {' '.join(map(str, d.windows))}]")
    p.add_argument("--knots", nargs="+", choices=KNOTS, metavar="LAYOUT",
                   help=f"knot layouts of {', '.join(KNOTS)} [default: {' '.join(d.knots)}]")
    p.add_argument("--subsample", nargs="*", type=number_arg(float, 0, strict=True), metavar="FRAC",
                   help=f"also time mode=subsample at these fractions [default: {' '.join(map(str, d.subsample))}]")
    p.add_argument("--interval-fracs", nargs="*", type=float, metavar="FRAC",
                   help=f"also time interval subsampling [default: {' '.join(map(str, d.interval_fracs))}]")
    p.add_argument("--corrections", nargs="*", type=float, metavar="P",
                   help=f"also time unbiased JAGG at these correction_p [default: {' '.join(map(str, d.corrections))}]")
    p.add_argument("--intermediates", nargs="+", choices=INTERMEDIATES, metavar="MODE",
                   help=f"inner-step velocities of {', '.join(INTERMEDIATES)} [default: {' '.join(d.intermediates)}]")
    p.add_argument("--batch", type=number_arg(int, 1), metavar="B", help=f"trajectories [default: {d.batch}]")
    p.add_argument("--steps", type=number_arg(int, 1), metavar="T",
                   help=f"sampling steps, all trained [default: {d.steps}]")
    p.add_argument("--micro-batch", type=number_arg(int, 2), metavar="N",
                   help=f"rows per network call [default: {d.micro_batch}]")
    p.add_argument("--repeats", type=number_arg(int, 1), metavar="N",
                   help=f"timed calls of each mode per pair [default: {d.repeats}]")
    p.add_argument("--guidance-scale", type=number_arg(float), metavar="W",
                   help=f"CFG scale (1 = off) [default: {d.guidance_scale}]")
    p.add_argument("--seed", type=number_arg(int, seed=True), help=f"seed [default: {d.seed}]")
    p.add_argument("--device", help="cpu or cuda [default: cpu]")
    p.add_argument("--threads", type=number_arg(int, 0), help="torch CPU threads (1: stable timings) [default: 0]")
    p.add_argument("--tiny-checkpoint", metavar="PATH", help="TinyDiT to time [default: builtin:tiny_dit]")
    p.add_argument("--sd3-layers", type=number_arg(int, 1), metavar="N",
                   help=f"SD3 transformer layers [default: {d.sd3.layers}]")
    p.add_argument("--sd3-heads", type=number_arg(int, 1), metavar="N",
                   help=f"SD3 heads of 64 channels [default: {d.sd3.heads}]")
    p.add_argument("--sd3-latent", type=number_arg(int, 2), metavar="N",
                   help=f"SD3 latent side [default: {d.sd3.latent_size}]")
    p.add_argument("--json", help="write the records to this JSON file")
    p.set_defaults(func=_run)
