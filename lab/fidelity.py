"""``python -m lab fidelity``: how close the JAGG gradient is to the exact one, and how well routing ranks it.

For each checkpoint, one fresh rollout batch is drawn through the trainer's pipeline
(:func:`jagg.trainers.rollout.rollout_batch`: the config's prompts, noise, SDE sampler with guidance and reward,
group-relative advantages, zero-spread prompt groups dropped), from RNGs of its own seed, and the gradients are those
of the parameters ``model.trainable`` marks. A config with a ``pipeline:`` section measures the user's diffusers
model instead (``--checkpoint`` does not apply): the batch is drawn by the diffusers trainer's own sampler
(:class:`jagg.trainers.diffusers_trainer.DiffusersSampler`, as ``jagg bench meter`` draws it: the model on
``pipeline.device``, its LoRA or trainable weights, ``sample.prompts_file``, the reward; ``--seed`` given replaces the
config's ``seed``) and the gradients are those of its trainable weights. Every gradient below comes from
:func:`jagg.policy_gradient`:

1. Fidelity, on-policy (right after sampling) and off-policy (the trainer's second minibatch: after one
   AdamW update on the first half of the batch with the configured estimator, the weights restored after): for
   every knot layout
   (``--knots``: groups (step groups), shared), window, alpha and intermediate mode, the rows it runs with grad, the
   cosine similarity and relative error ``||g_jagg - g_exact|| / ||g_exact||`` of the total gradient, and the
   cosine over the noisiest, the middle and the cleanest third of the trained steps, separately
   (:func:`jagg.audit_gradient`: the gradient of each third's loss terms, knots and routing those of the whole
   trajectory). The total is decided by the clean steps, whose signals are largest; layout is decided at the
   noisy ones. The Pareto table (rows against total cosine) marks the layouts no other beats on both.
2. Routing study (on-policy, windows > 2): per (sample, interval) pair the true gradient cosine of JAGG vs
   exact; the Spearman rank correlation of routing's linearity score (:func:`jagg.routing.linearity_scores`) with
   that cosine, and the total-gradient cosine reached when only the top ``jagg_frac`` by it go through JAGG, routing units
   of whole prompt groups (the trainer's way) and of single samples (also with the first and last intervals
   kept exact).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor, nn

from jagg.arguments import config_arguments
from jagg.checks import number_arg
from jagg.shapes.weights import load_model
from jagg.audit import audit_gradient
from jagg.estimator_config import ALPHAS, INTERMEDIATES, KNOTS, EstimatorConfig
from jagg.estimator import GradientStats, policy_gradient, reference_velocities
from jagg.shapes.guided_velocity import GuidedVelocity
from jagg.rewards.registry import get_reward
from jagg.knots import step_groups
from jagg.routing import linearity_scores
from jagg.schedule import flow_sigmas
from jagg.trainers.rollout import Batch, Rollout, rollout_inputs, rollout_batch, take
from jagg.trainers.diffusers_config import DiffusersTrainConfig, has_pipeline_section
from jagg.trainers.shapes_trainer import mark_trainable
from jagg.trainers.shapes_config import ShapesTrainConfig
from jagg.trajectory import Trajectory, VelocityFn, sample_trajectories
from jagg.shapes import from_tensor, tokenizer
from jagg.audit import cosine, flat_grad, rel_err
from jagg.bench.common import json_if_asked, resolve_device, set_threads, spearman, table
from jagg.bench.meter_command import TrainConfig, check_fixed_estimator, load_config, make_sampler, num_steps_of
from jagg.trainers.side_by_side import Sampler, restore_params
from jagg.trainers.sections import steps_source, trained_steps

ADVANTAGES = ("reward", "random")
SCORES = ("cosine",)            # routing's one linearity score (jagg.routing), the column name of the report


@dataclass
class FidelityConfig:
    checkpoints: list[str] = field(default_factory=lambda: ["builtin:tiny_dit"])
    windows: list[int] = field(default_factory=lambda: [3, 4, 5, 8])
    knots: list[str] = field(default_factory=lambda: list(KNOTS))
    alphas: list[str] = field(default_factory=lambda: ["sigma"])
    intermediates: list[str] = field(default_factory=lambda: ["interp", "fresh"])
    fracs: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0])
    advantages: str = "reward"     # "reward": the trainer's advantages; "random": N(0, 1) per sample, all kept
    routing: bool = True
    off_policy: bool = True
    seed: int = 0
    device: str = "cpu"
    threads: int = 0
    # sampling, reward, estimator and optimizer settings; a DiffusersTrainConfig: its model too (checkpoints unused)
    train: TrainConfig = field(default_factory=ShapesTrainConfig)

    def __post_init__(self):
        if not self.checkpoints:
            raise ValueError("give at least one --checkpoint")
        if not self.windows or any(w < 2 for w in self.windows):
            raise ValueError(f"--windows must be integers >= 2; got {self.windows}")
        bad = [k for k in self.knots if k not in KNOTS] + [a for a in self.alphas if a not in ALPHAS]
        if bad or not self.knots or not self.alphas:
            raise ValueError(f"--knots must be some of {KNOTS} and --alphas some of {ALPHAS}; got {self.knots}, "
                             f"{self.alphas}")
        bad = [i for i in self.intermediates if i not in INTERMEDIATES]
        if bad or not self.intermediates:
            raise ValueError(f"--intermediates must be some of {INTERMEDIATES}; got {self.intermediates}")
        if any(not 0 < f <= 1 for f in self.fracs):
            raise ValueError(f"--fracs must lie in (0, 1]; got {self.fracs}")
        if self.advantages not in ADVANTAGES:
            raise ValueError(f"--advantages must be one of {ADVANTAGES}; got {self.advantages!r}")
        if self.train.estimator.micro_batch < 2:
            raise ValueError("estimator.micro_batch must be >= 2 (JAGG endpoints go through together)")
        n, key = num_steps_of(self.train)
        K, steps = trained_steps(self.train.sample, n), steps_source(self.train.sample, key, n)
        if K > 2 and max(self.windows) > K:           # one interval would hold every step: never what was asked for
            raise ValueError(f"--windows {max(self.windows)} is more than the {K} trained steps of the config "
                             f"({steps}); give windows of at most {K}")


QUICK_SETS = ["sample.prompts_per_iter=4", "sample.group_size=4"]
QUICK_FRACS = [0.5, 1.0]


# ----------------------------------------------------------------------------- rollout


@dataclass
class KeptBatch:
    """A batch as the trainer trains it: trajectories, prompt tokens, advantages, reference velocities."""

    traj: Trajectory
    tokens: Tensor | list   # [B, L] prompt tokens; a diffusers sampler's conditioning: the prompts
    adv: Tensor             # [B]
    ref_v: Tensor | None    # [B, T, *S] when estimator.kl_beta > 0
    reward_mean: float
    sampled: int            # samples drawn before dropping zero-spread prompt groups
    prompt_groups: Tensor   # [B] prompt group of each sample, for routing

    def select(self, idx: Tensor) -> "KeptBatch":
        return KeptBatch(self.traj.select(idx), take(self.tokens, idx), self.adv[idx],
                       None if self.ref_v is None else self.ref_v[idx], self.reward_mean, self.sampled,
                       self.prompt_groups[idx.cpu()])


def draw_rollout(model: nn.Module, cfg: FidelityConfig, device: torch.device) -> KeptBatch:
    """One batch through the trainer's pipeline (:func:`jagg.trainers.rollout.rollout_batch`): the config's prompts
    (``sample.prompts_file`` or the training split), noise, SDE sampler with guidance and reward; advantages, the
    zero-spread prompt groups dropped and prompt groups as in training (``--advantages random``: N(0, 1), all kept)."""
    c, t = cfg.train.sample, cfg.train
    shape = (model.config.channels, model.config.image_size, model.config.image_size)
    draw = rollout_inputs(c, c.prompts(), shape, c.num_steps, np.random.default_rng(cfg.seed),
                                  torch.Generator().manual_seed(cfg.seed))
    tokens = tokenizer.encode(draw.prompts, max_len=model.config.max_text_len).to(device)

    def sample() -> Rollout:
        traj = sample_trajectories(GuidedVelocity(model, tokens, c.guidance_scale), draw.noise.to(device),
                                   flow_sigmas(c.num_steps, c.shift), c.eta, draw.train_steps, draw.sde_mask,
                                   generator=torch.Generator(device=device).manual_seed(cfg.seed),
                                   micro_batch=c.micro_batch, sde_type=c.sde_type)
        return Rollout(draw.prompts, slice(0, len(draw.prompts)), traj, tokens)

    reward = get_reward(t.reward.spec)
    batch = rollout_batch(sample, lambda ro: reward(from_tensor(ro.traj.latents[:, -1].cpu()), ro.prompts, None), t)
    reference = lambda cond: GuidedVelocity(copy.deepcopy(model).requires_grad_(False), cond, c.guidance_scale)
    return kept(batch, cfg, reference, device)


def sampler_rollout(sampler: Sampler, cfg: FidelityConfig) -> KeptBatch:
    """One batch of the trainer's own sampler (a diffusers config's :class:`~jagg.trainers.diffusers_trainer.DiffusersSampler`:
    its prompts, noise, SDE and reward, as ``jagg bench meter`` draws it), kept as :func:`draw_rollout` keeps
    it (the KL reference: the sampler's)."""
    return kept(rollout_batch(sampler.sample, sampler.score, cfg.train), cfg, sampler.reference, sampler.device)


def kept(batch: Batch, cfg: FidelityConfig, reference: Callable[[object], VelocityFn],
         device: torch.device) -> KeptBatch:
    """The samples of ``batch`` that train, with their advantages (``--advantages random``: N(0, 1), all kept) and,
    when ``estimator.kl_beta > 0``, the velocities of ``reference(conditioning)``, the KL reference's callable."""
    n, t, cond = len(batch.rollout.prompts), cfg.train, batch.rollout.conditioning
    adv, keep = batch.advantages, batch.keep
    if cfg.advantages == "random":
        adv = torch.randn(n, generator=torch.Generator().manual_seed(cfg.seed))
        keep = torch.ones(n, dtype=torch.bool)
    if not bool(keep.any()):
        raise ValueError("no prompt group of the rollout has a reward spread, so every advantage is 0 and there is "
                         "no gradient to compare; use a trained checkpoint, more prompts "
                         "(--set sample.prompts_per_iter=...), or --advantages random")
    traj, ref_v = batch.rollout.traj, None
    if t.estimator.kl_beta > 0:
        ref_v = reference_velocities(reference(cond), traj, t.estimator.micro_batch)
    ro = KeptBatch(traj, cond, adv.to(device), ref_v, float(batch.rewards.mean()), n, batch.prompt_groups)
    return ro.select(torch.nonzero(keep).flatten().to(device))


# ----------------------------------------------------------------------------- gradients


class CheckpointModel:
    """A shapes checkpoint as the gradients below use a model: the interface of the trainers' samplers
    (:class:`jagg.trainers.shapes_trainer.ShapesSampler`, :class:`jagg.trainers.diffusers_trainer.DiffusersSampler`) that they need,
    :meth:`velocity` (with the config's guidance), :attr:`params` (the trainable ones) and :meth:`zero_grad`."""

    def __init__(self, model: nn.Module, guidance: float):
        self.model, self.guidance = model, guidance
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.flat_params = list(model.parameters())      # what a flattened gradient spans (zeros where frozen)

    def velocity(self, tokens: Tensor) -> VelocityFn:
        return GuidedVelocity(self.model, tokens, self.guidance)

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)


Subject = CheckpointModel | Sampler      # what a gradient is taken of: velocity(conditioning), params, zero_grad()


def gradient(sub: Subject, ro: KeptBatch, est: EstimatorConfig, steps: list[int] | None = None,
             route_groups: bool = True) -> tuple[Tensor, GradientStats]:
    """The flattened gradient ``policy_gradient`` accumulates (``.grad`` zeroed first; every parameter of a
    checkpoint, a sampler's trainable ones), optionally with the trajectory's trained steps restricted to ``steps``
    (one interval of the layout: its own window, which a shorter last interval of the layout has);
    routing moves whole prompt groups unless ``route_groups`` is False (then single samples)."""
    traj = ro.traj
    if steps is not None:
        ts = torch.tensor(steps, dtype=torch.long, device=traj.latents.device)
        traj = dataclasses.replace(traj, train_steps=ts)
        est = dataclasses.replace(est, window=min(est.window, len(steps)))
    sub.zero_grad()
    stats = policy_gradient(sub.velocity(ro.tokens), traj, ro.adv, est, ref_velocities=ro.ref_v,
                            prompt_groups=ro.prompt_groups if route_groups else None)
    g = flat_grad(getattr(sub, "flat_params", sub.params))
    sub.zero_grad()
    return g, stats


def _est(base: EstimatorConfig, **kw) -> EstimatorConfig:
    """The configured estimator (micro-batch, clip range, KL) with JAGG everywhere and no unbiased correction (a
    same-batch comparison of a random estimate says little) unless ``kw`` says otherwise."""
    d = dict(base.plain().to_dict(), jagg_frac=1.0, exact_first_intervals=0, exact_last_intervals=0,
             interval_frac=1.0)
    return EstimatorConfig.from_dict({**d, **kw})


def fidelity(sub: Subject, ro: KeptBatch, cfg: FidelityConfig, policy: str, ckpt: str) -> list[dict]:
    """Rows, total and per-third cosine / relative error against exact, for every layout, window, alpha and mode."""
    base = cfg.train.estimator
    _, st_ex = gradient(sub, ro, _est(base, mode="exact"))
    params = sub.params
    vf = sub.velocity(ro.tokens)
    head = {"kind": "fidelity", "checkpoint": ckpt, "policy": policy, "samples": ro.traj.batch_size,
            "steps": ro.traj.train_steps.tolist(), "backward_items_exact": st_ex.backward_items}
    out = []
    for knots in cfg.knots:
        for W in cfg.windows:
            for alpha in cfg.alphas:
                for inter in cfg.intermediates:
                    est = _est(base, mode="jagg", window=W, knots=knots, alpha=alpha, intermediate=inter)
                    _, st = gradient(sub, ro, est)
                    a = audit_gradient(vf, ro.traj, ro.adv, est, params, ro.ref_v, ro.prompt_groups,
                                       torch.Generator().manual_seed(cfg.seed))
                    out.append({**head, "scope": "total", "knots": knots, "window": W, "alpha": alpha,
                                "intermediate": inter, "backward_items_jagg": st.backward_items,
                                "forward_nograd_items_jagg": st.forward_nograd_items,
                                "cosine": a["cos"], "rel_err": a["rel_err"],
                                **{k: v for k, v in a.items() if k.startswith("cos_")},
                                "clip_frac_exact": st_ex.clip_frac, "clip_frac_jagg": st.clip_frac,
                                "ratio_mean": st_ex.ratio_mean})
    return out


def pareto(records: list[dict]) -> list[dict]:
    """The records no other record of the same checkpoint and policy beats on both rows (fewer) and cosine."""
    front = []
    defined = [r for r in records if r["cosine"] is not None]        # None: undefined (a zero exact gradient)
    for r in defined:
        rivals = [x for x in defined if (x["checkpoint"], x["policy"]) == (r["checkpoint"], r["policy"]) and x is not r]
        if not any(x["backward_items_jagg"] <= r["backward_items_jagg"] and x["cosine"] >= r["cosine"]
                   and (x["backward_items_jagg"], x["cosine"]) != (r["backward_items_jagg"], r["cosine"])
                   for x in rivals):
            front.append(r)
    return front


def off_policy_rollout(sub: Subject, ro: KeptBatch, cfg: FidelityConfig) -> KeptBatch | None:
    """The trainer's second minibatch, with ``sub``'s trainable parameters moved in place by one AdamW update on the
    first minibatch (the caller restores them: :func:`jagg.bench.meter_command.restore_params`)."""
    B = ro.traj.batch_size
    if B < 2:
        print("fidelity: skipping off-policy: fewer than 2 samples kept")
        return None
    t = cfg.train
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(cfg.seed + 1)).to(ro.traj.latents.device)
    first, second = perm.tensor_split(2)
    o = t.optim
    opt = o.optimizer(sub.params)
    sub.zero_grad()
    mb = ro.select(first)
    policy_gradient(sub.velocity(mb.tokens), mb.traj, mb.adv, t.estimator, ref_velocities=mb.ref_v)
    if o.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_([p for p in sub.params if p.grad is not None], o.max_grad_norm)
    opt.step()
    sub.zero_grad()
    return ro.select(second)


def routing(sub: Subject, ro: KeptBatch, cfg: FidelityConfig, ckpt: str) -> list[dict]:
    """Spearman of each score with the true per-(sample, interval) cosine; total cosine per ``jagg_frac``."""
    base = cfg.train.estimator
    traj, B = ro.traj, ro.traj.batch_size
    steps = traj.train_steps.tolist()
    g_ex, _ = gradient(sub, ro, _est(base, mode="exact"))
    head = {"checkpoint": ckpt, "intermediate": base.intermediate, "samples": B}
    out = []
    for W in [w_ for w_ in cfg.windows if w_ > 2]:
        intervals = step_groups(steps, W)
        eligible = [j for j, iv in enumerate(intervals) if len(iv) > 2]
        if not eligible:
            continue
        est = _est(base, mode="jagg", window=W)
        cos = torch.full((B, len(intervals)), math.nan, dtype=torch.float64)
        for i in range(B):                                  # the true per-(sample, interval) cosine
            one = ro.select(torch.tensor([i], device=traj.latents.device))
            for j in eligible:
                ge, _ = gradient(sub, one, _est(base, mode="exact"), intervals[j])
                gj, _ = gradient(sub, one, est, intervals[j])
                c = cosine(gj, ge)
                cos[i, j] = math.nan if c is None else c
        valid = torch.isfinite(cos)                         # NaN: undefined, a zero gradient (zero advantage)
        for score in (SCORES if bool(valid.any()) else ()):
            sc = linearity_scores(traj.velocities, intervals).cpu().double()
            out.append({**head, "kind": "spearman", "window": W, "score": score,
                        "spearman": spearman(sc[valid].tolist(), cos[valid].tolist()),
                        "pairs": int(valid.sum()), "mean_pair_cosine": float(cos[valid].mean()),
                        "min_pair_cosine": float(cos[valid].min())})
        for edge in (0, 1):
            for frac in cfg.fracs:
                for unit in (("prompt_group", "sample") if frac < 1 else ("any",)):   # frac 1 routes everything
                    for score in (SCORES if frac < 1 else SCORES[:1]):
                        e = _est(base, mode="jagg", window=W, jagg_frac=frac,
                                 exact_first_intervals=edge, exact_last_intervals=edge)
                        g, st = gradient(sub, ro, e, route_groups=unit == "prompt_group")
                        out.append({**head, "kind": "routing", "window": W, "score": score if frac < 1 else "any",
                                    "route_unit": unit, "jagg_frac": frac, "exact_first_intervals": edge,
                                    "exact_last_intervals": edge, "cosine": cosine(g, g_ex), "rel_err": rel_err(g, g_ex),
                                    "jagg_frac_routed": st.jagg_frac_routed, "backward_items": st.backward_items})
    return out


# ----------------------------------------------------------------------------- report


def _print_report(records: list[dict]) -> None:
    totals = [r for r in records if r["kind"] == "fidelity" and r["scope"] == "total"]
    front = {id(r) for r in pareto(totals)}
    rows = sorted(totals, key=lambda r: (r["checkpoint"], r["policy"], r["backward_items_jagg"],
                                        -r["cosine"] if r["cosine"] is not None else math.inf))
    for r in rows:
        r["_pareto"] = "*" if id(r) in front else ""
    print("\nfidelity (Pareto table: rows with grad against the cosine to exact, * = no layout has fewer rows and a "
          "higher cosine); per third of the trained steps: noisy, middle, clean")
    print(table(rows, [("checkpoint", "checkpoint", ""), ("policy", "policy", ""), ("knots", "knots", ""),
                       ("window", "W", ""), ("alpha", "alpha", ""), ("intermediate", "interm.", ""),
                       ("backward_items_jagg", "rows", ""), ("backward_items_exact", "exact rows", ""),
                       ("cosine", "cos total", ".4f"), ("rel_err", "rel.err", ".3f"), ("cos_noisy", "cos noisy", ".4f"),
                       ("cos_middle", "cos middle", ".4f"), ("cos_clean", "cos clean", ".4f"), ("_pareto", "pareto", "")]))
    for r in rows:
        r.pop("_pareto")
    sp = [r for r in records if r["kind"] == "spearman"]
    if sp:
        print("\nrouting scores: Spearman rank correlation with the true per-(sample, interval) gradient cosine")
        print(table(sp, [("checkpoint", "checkpoint", ""), ("window", "W", ""), ("score", "score", ""),
                         ("spearman", "spearman", ".3f"), ("pairs", "pairs", ""),
                         ("mean_pair_cosine", "mean pair cos", ".4f"), ("min_pair_cosine", "min pair cos", ".4f")]))
    rt = [r for r in records if r["kind"] == "routing"]
    if rt:
        rows = {}
        for r in rt:
            key = (r["checkpoint"], r["window"], r["exact_first_intervals"], r["jagg_frac"], r["route_unit"])
            row = rows.setdefault(key, {"checkpoint": key[0], "window": key[1], "edges": key[2], "jagg_frac": key[3],
                                        "unit": key[4], "backward_items": r["backward_items"]})
            for s in SCORES:
                if r["score"] in (s, "any"):
                    row[s] = r["cosine"]
        print("\nrouting: total-gradient cosine vs exact when the top jagg_frac by each score go through JAGG; unit "
              "prompt_group: whole prompt groups, sample: single samples (edges=1: first and last intervals exact)")
        cols = [("checkpoint", "checkpoint", ""), ("window", "W", ""), ("edges", "edges", ""),
                ("jagg_frac", "frac", ".2f"), ("unit", "unit", ""), ("backward_items", "bwd", "")]
        print(table(list(rows.values()), cols + [(s, s, ".4f") for s in SCORES]))


def subjects(cfg: FidelityConfig):
    """``(label, subject, rollout)`` of each model to measure, built as iterated: every ``--checkpoint`` of the shapes
    world (``model.trainable`` marked, :func:`draw_rollout`), or a diffusers config's model through its trainer's
    sampler (:func:`sampler_rollout`)."""
    if isinstance(cfg.train, DiffusersTrainConfig):
        p = cfg.train.pipeline
        sampler = make_sampler(cfg.train)
        yield f"{p.family}:{Path(p.path).name}", sampler, sampler_rollout(sampler, cfg)
        return
    device = resolve_device(cfg.device)
    for ckpt in cfg.checkpoints:
        model = load_model(ckpt).to(device).train()
        mark_trainable(model, cfg.train.model.trainable)          # the gradients of the trained parameters only
        yield ckpt, CheckpointModel(model, cfg.train.sample.guidance_scale), draw_rollout(model, cfg, device)


def run_fidelity(cfg: FidelityConfig) -> list[dict]:
    set_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    records = []
    for ckpt, sub, ro in subjects(cfg):
        print(f"{ckpt}: rollout of {ro.sampled} samples, reward {ro.reward_mean:.3f}, {ro.traj.batch_size} kept "
              f"(advantages: {cfg.advantages}); trained steps {ro.traj.train_steps.tolist()}", flush=True)
        records += fidelity(sub, ro, cfg, "on", ckpt)
        if cfg.off_policy:
            saved = [p.detach().clone() for p in sub.params]
            off = off_policy_rollout(sub, ro, cfg)
            if off is not None:
                records += fidelity(sub, off, cfg, "off", ckpt)
            restore_params(sub, saved)                             # routing: on-policy again
        if cfg.routing:
            records += routing(sub, ro, cfg, ckpt)
    return records


# ----------------------------------------------------------------------------- command line


def load_train_config(args: argparse.Namespace) -> TrainConfig:
    """The trainer config of ``--config`` (:func:`jagg.bench.meter_command.load_config`: a diffusers one with a
    ``pipeline:`` section) with ``--quick``'s and ``--set``'s keys; for a diffusers config ``--seed`` becomes its
    ``seed``, and the options of the shapes world's checkpoints are refused, naming them."""
    sets = (QUICK_SETS if args.quick else []) + list(args.set or [])
    diffusers = has_pipeline_section(args.config)
    if diffusers:
        for flag, value, instead in (("--checkpoint", args.checkpoint, "pipeline.path (and pipeline.lora)"),
                                     ("--device", args.device, "pipeline.device")):
            if value is not None:
                raise ValueError(f"{flag}: a config with a pipeline: section measures its own model; set {instead} "
                                 "instead (--set)")
        if args.seed is not None:
            sets.append(f"seed={args.seed}")
    return check_fixed_estimator(load_config(args.config, sets), "python -m lab fidelity")


def _run(args: argparse.Namespace) -> int:
    train = load_train_config(args)
    d = FidelityConfig()
    seed = train.seed if isinstance(train, DiffusersTrainConfig) else (args.seed or 0)
    cfg = FidelityConfig(
        checkpoints=args.checkpoint or d.checkpoints, windows=args.windows or d.windows,
        knots=args.knots or d.knots, alphas=args.alphas or d.alphas,
        intermediates=args.intermediates or d.intermediates,
        fracs=args.fracs or (QUICK_FRACS if args.quick else d.fracs),
        advantages=args.advantages, routing=not args.no_routing, off_policy=not args.no_off_policy,
        seed=seed, device=args.device or d.device,
        threads=args.threads if args.threads is not None else train.threads, train=train)
    records = run_fidelity(cfg)
    _print_report(records)
    json_if_asked(args.json, records)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("fidelity", help="JAGG vs exact gradient cosine per knot layout, in total and per third of the "
                       "steps (Pareto table of rows vs cosine); routing-score study",
                       description=__doc__.replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter)
    d = FidelityConfig()
    p.add_argument("--checkpoint", action="append",
                   help="a trained shapes-world checkpoint (builtin:tiny_dit, .safetensors, training .pt or run dir); "
                        "repeatable; not with a diffusers config [default: builtin:tiny_dit]")
    config_arguments(p, "its sample/reward/grpo/estimator/optim settings define the rollout and the loss; one with a "
                        "pipeline: section measures that diffusers model with the diffusers trainer's sampler",
                     "sample.prompts_per_iter=16")
    p.add_argument("--quick", action="store_true",
                   help=f"a smaller study: {' '.join(QUICK_SETS)}, --fracs {' '.join(map(str, QUICK_FRACS))}")
    p.add_argument("--windows", nargs="+", type=number_arg(int, 2), help=f"[default: {' '.join(map(str, d.windows))}]")
    p.add_argument("--knots", nargs="+", choices=KNOTS, help=f"knot layouts [default: {' '.join(d.knots)}]")
    p.add_argument("--alphas", nargs="+", choices=ALPHAS, help="interpolation coefficients [default: sigma]")
    p.add_argument("--intermediates", nargs="+", choices=INTERMEDIATES,
                   help=f"[default: {' '.join(d.intermediates)}]")
    p.add_argument("--fracs", nargs="+", type=number_arg(float, 0, strict=True),
                   help=f"routing jagg_frac values [default: {' '.join(map(str, d.fracs))}]")
    p.add_argument("--advantages", choices=ADVANTAGES, default="reward",
                   help="reward: the trainer's group-relative advantages (zero-spread prompt groups dropped); random: "
                        "N(0,1) per sample, for untrained checkpoints [default: reward]")
    p.add_argument("--no-routing", action="store_true", help="skip the routing study")
    p.add_argument("--no-off-policy", action="store_true", help="skip the off-policy (after one update) comparison")
    p.add_argument("--seed", type=number_arg(int, seed=True),
                   help="seed of prompts, noise and the minibatch split [default: 0; a diffusers config: its seed]")
    p.add_argument("--device", help="cpu or cuda; a diffusers config: pipeline.device instead [default: cpu]")
    p.add_argument("--threads", type=number_arg(int, 0), help="torch CPU threads [default: the config's threads]")
    p.add_argument("--json", help="write the records to this JSON file")
    p.set_defaults(func=_run)
