"""``python -m lab signal``: does the policy gradient carry a learnable signal at this batch size?

GRPO only improves a reward when the gradient of one update points, more than by chance, where the next one
does. This benchmark measures that directly, with the trainer's own sampler
(:class:`jagg.trainers.shapes_trainer.ShapesSampler` of the same config, or for a config with a ``pipeline:`` section the
diffusers trainer's :class:`jagg.trainers.diffusers_trainer.DiffusersSampler`: the user's model, LoRA, prompts and KL
reference; no run directory) and the trainer's own gradient
(:func:`jagg.policy_gradient`, no optimizer step), each reward's batch through the trainer's pipeline
(:func:`jagg.trainers.rollout.rollout_batch`: advantages, zero-spread prompt groups dropped): it draws ``K`` independent
batches, computes one gradient ``g_i``
per batch over the trainable parameters, and reports per reward

    c = mean_{i != j} cos(g_i, g_j)

the expected cosine between two updates (jackknife standard error over the batches). With ``N`` samples per
batch and gradient norms that vary little, ``c ~ N s / (N s + 1)`` where ``s`` is the per-sample
signal-to-noise ratio ``|E g_1|^2 / tr Cov(g_1)``, so ``s = c / ((1 - c) N)`` and two updates agree with a
cosine of 0.5 from ``1 / s`` samples per update on (reported as a lower bound from ``c + 2 SE`` when ``c``
is not significant). A value of ``c`` near 0 means the update is noise: Adam turns it into a random walk
that drifts the model away from its pretrained optimum.

Several rewards (``--rewards``) are compared on the same trajectories: each batch is sampled once and
differentiated once per reward, with the same random picks of unbiased JAGG (``correction_p``) for every reward (an
RNG seeded by the seed and the batch), so a reward's row is the same whatever other rewards are measured. ``--estimators config exact`` also differentiates each batch with the exact
estimator and reports the cross-agreement ``mean_{i != j} cos(g_jagg_i, g_exact_j)`` (does a JAGG update
point where an exact update on another batch points?) next to the same-batch cosine (the fidelity metric of
``python -m lab fidelity``), which is dominated by the noise both share. ``--fixed-prompts`` gives every batch
the same prompts, which separates "no signal" from "a different direction for each prompt".

With both estimators it also reports the **bias consistency**: the agreement ``mean_{i != j} cos(e_i, e_j)`` of the
estimator's errors ``e_i = g_config_i - g_exact_i`` on independent batches, next to the agreement of the exact
gradients. An error whose direction repeats from batch to batch is a bias that Adam integrates like signal; if its
repeating part ``sqrt(c_e) |e|`` is comparable to the exact gradient's ``sqrt(c) |g|`` (``bias_to_signal``), the
estimator can drive training somewhere the reward does not want (docs/results.md).
"""

from __future__ import annotations

import argparse
import math
import statistics

import numpy as np
import torch

from jagg.arguments import config_arguments
from jagg.audit import flat_grad
from jagg.meter import jackknife_se
from jagg.estimator import policy_gradient, reference_velocities
from jagg.rewards.registry import get_reward
from jagg.trainers.rollout import rollout_batch, take
from jagg.trainers.diffusers_config import DiffusersTrainConfig
from jagg.bench.meter_command import TrainConfig, check_fixed_estimator, check_kl, load_config, make_sampler
from jagg.checks import check_no_repeats, number_arg
from jagg.bench.common import json_if_asked, table

QUICK_SETS = ["sample.prompts_per_iter=4", "sample.group_size=4"]


def agreement(grads: torch.Tensor, other: torch.Tensor | None = None) -> tuple[float, float]:
    """``grads`` ``[K, P]`` (K >= 3 independent estimates) -> ``(c, jackknife standard error of c)``.

    ``c = mean_{i != j} cos(g_i, g_j)``: the expected cosine between two independent estimates (each
    estimate normalised first, so one batch with a large gradient does not dominate). With ``other``
    ``[K, P]`` (another estimator on the same K batches): ``mean_{i != j} cos(g_i, h_j)``, the agreement of
    one estimator's update with the other's on an independent batch, i.e. of their expected directions.
    """
    k = grads.shape[0]
    if k < 3:
        raise ValueError(f"need >= 3 gradient estimates for a standard error; got {k}")

    def normed(g: torch.Tensor) -> torch.Tensor:
        return g.double() / g.double().norm(dim=1, keepdim=True).clamp_min(1e-300)

    cos = normed(grads) @ normed(grads if other is None else other).T      # [K, K]

    def c_of(idx: list[int]) -> float:
        sub = cos[idx][:, idx]
        n = len(idx)
        return float((sub.sum() - sub.diagonal().sum()) / (n * (n - 1)))

    c = c_of(list(range(k)))
    return c, jackknife_se([c_of([j for j in range(k) if j != i]) for i in range(k)])


def samples_for_half(c: float, se: float, n: float) -> tuple[float, bool]:
    """Samples per update at which two updates have an expected cosine of 0.5, and whether that is a
    lower bound (``c`` within 2 SE of 0: computed from ``c + 2 SE``)."""
    bound = c <= 2 * se
    cc = c + 2 * se if bound else c
    if cc <= 0:
        return math.inf, True
    cc = min(cc, 1 - 1e-12)
    return n * (1 - cc) / cc, bound


def reward_fns(cfg: TrainConfig, rewards: list[str]) -> dict:
    """``{name: reward}`` of ``--rewards``: registry names or ``module:function``; a diffusers config's on its
    pipeline's device and dtype, and its ``reward_server`` by the name ``reward_server``."""
    if not isinstance(cfg, DiffusersTrainConfig):
        return {name: get_reward(name) for name in rewards}
    opts = {"device": cfg.pipeline.resolve_device(), "dtype": cfg.pipeline.dtype}
    server = cfg.reward_server
    return {name: get_reward(server if name == "reward_server" and server is not None else name, opts)
            for name in rewards}


def default_rewards(cfg: TrainConfig) -> list[str]:
    """The config's reward: its ``reward.name``, the components of its ``reward.weights`` with a weight > 0, or
    (a diffusers config with a ``reward_server``) ``reward_server``."""
    if cfg.reward is None:
        return ["reward_server"]
    return [cfg.reward.name] if cfg.reward.name else [k for k, w in cfg.reward.weights.items() if w]


def trainable_of(cfg: TrainConfig) -> str:
    """What trains, as the records name it: ``model.trainable``, or a diffusers config's LoRA or all weights."""
    if isinstance(cfg, DiffusersTrainConfig):
        return "pipeline.lora" if cfg.pipeline.lora.enabled else "all"
    return cfg.model.trainable


def measure(cfg: TrainConfig, rewards: list[str], batches: int, fixed_prompts: bool = False,
            estimators: tuple[str, ...] = ("config",)) -> list[dict]:
    """Records per (reward, estimator): the agreement of ``batches`` independent gradient estimates (module
    docstring). ``estimators``: ``config`` (the config's estimator) and/or ``exact``; with both, one more record
    per reward compares them (``estimator: "config x exact"``)."""
    if batches < 3:
        raise ValueError(f"--batches must be >= 3; got {batches}")
    bad = [e for e in estimators if e not in ESTIMATORS]
    if bad or not estimators:
        raise ValueError(f"--estimators must be some of {ESTIMATORS}; got {list(estimators)}")
    if not rewards:
        raise ValueError("--rewards: give at least one reward")
    check_no_repeats(list(rewards), "--rewards")
    check_no_repeats(list(estimators), "--estimators")
    fns = reward_fns(cfg, rewards)
    ests = {"config": cfg.estimator, "exact": cfg.estimator.exact()}
    sampler = make_sampler(cfg)
    grads = {(name, e): [] for name in rewards for e in estimators}
    spread = {name: [] for name in rewards}
    stds = {name: [] for name in rewards}
    means = {name: [] for name in rewards}
    trained = []
    for b in range(batches):
        if fixed_prompts:
            sampler.np_rng = np.random.default_rng(cfg.seed)
        rollout = sampler.sample()
        images = sampler.decode(rollout)
        trained.append(len(rollout.prompts))
        for name, fn in fns.items():                        # the trainer's pipeline, once per reward
            batch = rollout_batch(lambda: rollout, lambda ro: fn(images, ro.prompts, None), cfg)
            r = batch.rewards
            by_prompt = r.view(-1, cfg.sample.group_size)    # [prompts_per_iter, group_size]: the prompt groups
            spread[name].append(float((by_prompt.std(1) > 0).float().mean()))
            stds[name].append(float(by_prompt.std(1).mean()))
            means[name].append(float(r.mean()))
            idx = batch.keep_idx
            cond, traj = take(rollout.conditioning, idx), rollout.traj.select(idx)
            ref_v = None
            if idx.numel() and cfg.estimator.kl_beta > 0:  # the KL reference, once per reward's kept samples
                ref_v = reference_velocities(sampler.reference(cond), traj, cfg.estimator.micro_batch)
            for e in estimators:
                sampler.zero_grad()
                if idx.numel():                              # else nothing trains: a zero gradient
                    with torch.enable_grad():
                        policy_gradient(sampler.velocity(cond), traj, batch.advantages[idx], ests[e],
                                        ref_velocities=ref_v, prompt_groups=batch.prompt_groups[idx],
                                        generator=pick_generator(cfg.seed, b))
                grads[(name, e)].append(flat_grad(sampler.params))
    n = statistics.fmean(trained)
    out = []
    for name in rewards:
        head = {"reward": name, "batches": batches, "samples_per_batch": n, "fixed_prompts": fixed_prompts,
                "trainable": trainable_of(cfg), "reward_mean": statistics.fmean(means[name]),
                "within_prompt_group_std": statistics.fmean(stds[name]),
                "prompt_groups_with_spread": statistics.fmean(spread[name])}
        for e in estimators:
            g = torch.stack(grads[(name, e)])              # [K, P]
            c, se = agreement(g)
            need, bound = samples_for_half(c, se, n)
            out.append({**head, "estimator": e, "mode": ests[e].mode, "params": int(g.shape[1]),
                        "cosine": c, "cosine_se": se, "snr_per_sample": c / ((1 - c) * n) if 0 < c < 1 else None,
                        "samples_for_cosine_0.5": need, "lower_bound": bound,
                        "grad_norm": float(g.norm(dim=1).mean())})
        if len(estimators) == 2:
            a, b = torch.stack(grads[(name, "config")]), torch.stack(grads[(name, "exact")])
            c, se = agreement(a, b)
            same = float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1).mean())
            out.append({**head, "estimator": "config x exact", "mode": f"{ests['config'].mode} x exact",
                        "params": int(a.shape[1]), "cosine": c, "cosine_se": se, "same_batch_cosine": same,
                        "snr_per_sample": None, "samples_for_cosine_0.5": math.nan, "lower_bound": False,
                        "grad_norm": float(a.norm(dim=1).mean())})
            out.append(bias_record(head, a, b))
    return out


def pick_generator(seed: int, batch: int) -> torch.Generator:
    """The RNG of unbiased JAGG's random picks on batch ``batch``: a fresh one for every (reward, estimator), seeded
    by the config's seed and the batch alone, so every reward sees the same picks on one batch and a reward's row does
    not depend on which other rewards are measured (with torch's global RNG the second reward's picks shifted the
    first reward's picks on every later batch)."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, 5, batch]).generate_state(1)[0]))


def bias_record(head: dict, config_grads: torch.Tensor, exact_grads: torch.Tensor) -> dict:
    """Bias consistency of one estimator from its gradients and the exact ones on the same ``K`` batches
    (``[K, P]`` each): the agreement of the errors across batches next to that of the exact gradients."""
    e = (config_grads - exact_grads).double()
    c_e, se_e = agreement(e)
    c_g, se_g = agreement(exact_grads)
    err, g = float(e.norm(dim=1).mean()), float(exact_grads.double().norm(dim=1).mean())
    repeat_e, repeat_g = math.sqrt(max(c_e, 0.0)) * err, math.sqrt(max(c_g, 0.0)) * g
    return {**head, "estimator": "error (config - exact)", "mode": "error", "params": int(e.shape[1]),
            "cosine": c_e, "cosine_se": se_e, "exact_cosine": c_g, "exact_cosine_se": se_g,
            "rel_err": err / g if g > 0 else math.nan, "bias_to_signal": repeat_e / repeat_g if repeat_g > 0 else math.nan,
            "snr_per_sample": None, "samples_for_cosine_0.5": math.nan, "lower_bound": False, "grad_norm": err}


COLUMNS = [("reward", "reward", ""), ("mode", "estimator", ""), ("samples_per_batch", "N", ".0f"),
           ("cosine", "cos(g_i, g_j)", ".4f"),
           ("cosine_se", "± SE", ".4f"), ("need", "N for cos 0.5", ""),
           ("reward_mean", "reward", ".3f"), ("within_prompt_group_std", "prompt group std", ".3f"),
           ("prompt_groups_with_spread", "prompt groups w/ spread", ".2f"), ("grad_norm", "|g|", ".2e"),
           ("same_batch_cosine", "same-batch cos", ".4f"), ("rel_err", "|e|/|g|", ".3f"),
           ("bias_to_signal", "bias/signal", ".2f")]
ESTIMATORS = ("config", "exact")


def _run(args: argparse.Namespace) -> int:
    sets = (QUICK_SETS if args.quick else []) + list(args.set or [])
    cfg = check_fixed_estimator(load_config(args.config, sets), "python -m lab signal")
    check_kl(cfg)
    rewards = args.rewards or default_rewards(cfg)
    batches = args.batches if args.batches is not None else (3 if args.quick else 8)
    records = measure(cfg, rewards, batches, args.fixed_prompts, tuple(args.estimators))
    shown = [{**r, "need": "" if math.isnan(r["samples_for_cosine_0.5"]) else (">= " if r["lower_bound"] else "") + (
        "inf" if math.isinf(r["samples_for_cosine_0.5"]) else f"{r['samples_for_cosine_0.5']:.0f}")} for r in records]
    print(f"{batches} batches of {records[0]['samples_per_batch']:.0f} samples, gradients over "
          f"{records[0]['params']} trainable parameters ({trainable_of(cfg)!r})"
          f"{', the same prompts in every batch' if args.fixed_prompts else ''}")
    print(table(shown, COLUMNS))
    json_if_asked(args.json, records)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("signal", help="gradient agreement between independent batches: is there a signal to learn?",
                       description=__doc__.replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter)
    config_arguments(p, "the job measured; one with a pipeline: section measures that diffusers model (as jagg train "
                        "loads it)", "model.trainable=all")
    p.add_argument("--rewards", nargs="+", metavar="REWARD",
                   help="rewards to compare on the same trajectories: registry names or module:function (a diffusers "
                        "config's server: reward_server) [default: the config's reward.name, or the components of its "
                        "reward.weights with a weight > 0, or its reward_server]")
    p.add_argument("--batches", type=number_arg(int, 3),
                   help="independent batches K (>= 3) [default: 8; 3 with --quick]")
    p.add_argument("--fixed-prompts", action="store_true", help="every batch uses the same prompts")
    p.add_argument("--estimators", nargs="+", choices=ESTIMATORS, default=["config"],
                   help="config: the config's estimator; exact: mode=exact; both: also their cross-agreement "
                        "'config x exact' (does the JAGG update point where the exact one does?) [default: config]")
    p.add_argument("--json", help="also write the records to this JSON file")
    p.add_argument("--quick", action="store_true", help=f"smaller batches: {' '.join(QUICK_SETS)}")
    p.set_defaults(func=_run)
