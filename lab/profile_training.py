"""Profile one training phase of the main job: where does the time of ``jagg.policy_gradient`` go?

Samples one iteration's batch exactly as ``jagg train`` does (its sampler, ``jagg.trainers.shapes_trainer.ShapesSampler``, of the
main job or ``--config`` plus ``--set``; no run directory), then runs
the training phase (one ``policy_gradient`` call over the batch) in ``exact`` and in the configured JAGG mode
under ``torch.profiler``. The velocity function and the backward are wrapped in ``record_function`` labels
through the estimator's public hooks, so the wall time splits into

    network forward   every call of the velocity function (with or without grad)
    network backward  every ``backward_fn`` call (autograd through the network and the loss head)
    rest              everything else: the SDE log-prob and loss head, routing scores, interpolation,
                      bookkeeping and Python

and the top operators of "rest" are listed. Usage::

    python -m lab profile-training [--set KEY=VALUE ...] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from jagg import policy_gradient
from jagg.infra import config_loader as configuration
from jagg.advantages import group_advantages
from jagg.arguments import config_arguments, overwrite_argument
from jagg.infra.atomic import write_json
from jagg.checks import check_output_file
from jagg.estimator_config import EstimatorConfig
from jagg.trainers.shapes_trainer import ShapesSampler
from jagg.trainers.shapes_config import ShapesTrainConfig

LABELS = ("network_forward", "network_backward")


class LabelledVelocity:
    """The trainer's velocity function with every call inside ``record_function('network_forward')``."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        with record_function("network_forward"):
            return self.fn(*args, **kwargs)


def labelled_backward(loss):
    with record_function("network_backward"):
        loss.backward()


def phase(sampler: ShapesSampler, batch, est: EstimatorConfig) -> float:
    prompts, tokens, traj, adv = batch
    sampler.zero_grad()
    vf = LabelledVelocity(sampler.velocity(tokens))
    t0 = time.perf_counter()
    with torch.enable_grad():
        policy_gradient(vf, traj, adv, est, backward_fn=labelled_backward)
    return time.perf_counter() - t0


def profile_mode(sampler: ShapesSampler, batch, est: EstimatorConfig, repeats: int) -> dict:
    phase(sampler, batch, est)                                    # warm-up
    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            walls.append(phase(sampler, batch, est))
    wall = sum(walls)
    label_s = dict.fromkeys(LABELS, 0.0)
    outside: dict[str, list] = {}                                 # op -> [self seconds, calls] outside the labels
    for e in prof.events():
        if e.name in LABELS:
            label_s[e.name] += e.cpu_time_total / 1e6
            continue
        p = e.cpu_parent
        while p is not None and p.name not in LABELS:
            p = p.cpu_parent
        if p is None:
            acc = outside.setdefault(e.name, [0.0, 0])
            acc[0] += e.self_cpu_time_total / 1e6
            acc[1] += 1
    rest = wall - sum(label_s.values())
    top = sorted(outside.items(), key=lambda kv: kv[1][0], reverse=True)[:12]
    return {
        "mode": est.mode, "window": est.window, "intermediate": est.intermediate, "jagg_frac": est.jagg_frac,
        "repeats": repeats, "wall_s_median": statistics.median(walls),
        "forward_s": label_s["network_forward"] / repeats, "backward_s": label_s["network_backward"] / repeats,
        "rest_s": rest / repeats, "rest_fraction": rest / wall,
        "top_ops_outside_network": [{"op": k, "self_cpu_s": v[0] / repeats, "calls": v[1] // repeats} for k, v in top],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab profile-training", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    config_arguments(ap, "the job whose training phase is profiled")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the records to this JSON file")
    overwrite_argument(ap, "--json")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1; got {args.repeats}")
    if args.json is not None:
        check_output_file(args.json, "--json", args.overwrite, (".json",))
    cfg = configuration.load(ShapesTrainConfig, args.config, args.set)
    sampler = ShapesSampler(cfg)
    rollout = sampler.sample()
    prompts, tokens, traj = rollout.prompts, rollout.conditioning, rollout.traj
    scores, _ = sampler.score(rollout)
    adv = group_advantages(torch.as_tensor(scores, dtype=torch.float32), prompts, cfg.grpo.global_std,
                           cfg.grpo.adv_clip_max)
    batch = (prompts, tokens, traj, adv)
    exact = dataclasses.replace(cfg.estimator, mode="exact")
    records = [profile_mode(sampler, batch, est, args.repeats) for est in (exact, cfg.estimator)]
    print(f"one training phase of the main job: {len(prompts)} samples x {int(traj.train_steps.numel())} trained "
          f"steps, micro-batch {cfg.estimator.micro_batch}, {torch.get_num_threads()} thread(s)")
    for r in records:
        print(f"\n{r['mode']} (W={r['window']}, {r['intermediate']}, jagg_frac {r['jagg_frac']}): "
              f"wall {r['wall_s_median']:.3f} s; network forward {r['forward_s']:.3f} s, backward "
              f"{r['backward_s']:.3f} s, rest {r['rest_s']:.3f} s ({100 * r['rest_fraction']:.1f}%)")
        print("  top operators outside the network calls (self CPU s per phase, calls):")
        for op in r["top_ops_outside_network"]:
            print(f"    {op['op']:<40} {op['self_cpu_s']:.4f}  {op['calls']}")
    if args.json:
        write_json(args.json, records)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
