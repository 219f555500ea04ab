"""``jagg bench quality``: GRPO runs with exact and JAGG gradients on the embedded task, side by side.

Each variant (``exact``, ``jagg_fresh``, ``jagg_interp``) trains with :class:`jagg.shapes.trainer.Trainer` from the
same config (``configs/default.yaml`` plus ``--set`` overrides), for the same number of iterations and
optimizer updates, once per seed; the runs alternate (seed 0 of every variant, then seed 1, ...). Every run writes into ``OUT/<variant>/seed<k>/`` (the trainer's usual
outputs) and, when it is finished, ``result.json``; a run whose ``result.json`` exists for the requested
number of iterations (and the same config; another config is an error) is skipped and an unfinished one resumes from its newest checkpoint, so the benchmark
can be interrupted and restarted.

Reported: the held-out (test-split) reward against optimizer updates and against wall-clock seconds of
training iterations (the metrics' ``wall_s``; evaluation excluded), the final reward's mean and spread over
seeds, the training-phase time (sum of ``train_s``), and the iteration-time ratio exact / JAGG next to its
ideal: sampling and rewards unchanged, the training phase shrunk by the cost-model limit.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..training import config_loader as configuration
from ..shapes.config import TrainConfig
from ..trajectory import select_train_steps
from .common import default_config_path, table, write_json
from .e2e import VARIANTS, routed_limit
# bench defaults, before the user's --set (which win)
DEFAULT_SETS = ["log.progress=false", "log.tensorboard=false", "eval.every=10"]
QUICK_SETS = ["grpo.iterations=3", "sample.prompts_per_iter=4", "sample.group_size=4", "eval.every=1",
              "eval.num_prompts=8", "eval.images_per_prompt=1", "eval.grid_size=4", "log.checkpoint_every=0"]


@dataclass
class QualityConfig:
    config: str | None = None                 # trainer YAML
    sets: list[str] = field(default_factory=list)
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    out: str = "runs/bench_quality"

    def __post_init__(self):
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad or not self.variants:
            raise ValueError(f"--variants must be some of {list(VARIANTS)}; got {self.variants}")
        if not self.seeds:
            raise ValueError("--seeds must be >= 1")

    def train_config(self, variant: str, seed: int) -> TrainConfig:
        run = [f"seed={seed}", f"log.output_dir={self.run_dir(variant, seed)}"]
        sets = DEFAULT_SETS + self.sets + VARIANTS[variant] + run
        return configuration.load(TrainConfig, self.config, sets)

    def run_dir(self, variant: str, seed: int) -> Path:
        return Path(self.out) / variant / f"seed{seed}"


# ----------------------------------------------------------------------------- runs


def summarize(records: list[dict], cfg: TrainConfig, variant: str, seed: int) -> dict:
    """One run's result from its metrics records."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    per_iter = cfg.grpo.inner_epochs * cfg.grpo.updates_per_epoch
    mean = lambda k: statistics.fmean(r[k] for r in train) if train else float("nan")
    trained = sum(r.get("trained_samples", 0) for r in train)
    train_s = sum(r["train_s"] for r in train)
    e, c = cfg.estimator, cfg.sample
    steps = select_train_steps(c.num_steps, c.timestep_fraction, tuple(c.sde_window) if c.sde_window else None)[0]
    return {
        "kind": "run", "variant": variant, "seed": seed, "mode": e.mode, "window": e.window,
        "intermediate": e.intermediate, "jagg_frac": e.jagg_frac, "trained_steps": int(steps.numel()),
        "limit": routed_limit(cfg),
        "iterations": cfg.grpo.iterations, "updates": len(train) * per_iter,
        "final_reward": evals[-1]["reward_mean"] if evals else None,
        "final_held_out_reward": evals[-1].get("held_out_reward") if evals else None,
        "train_s_total": train_s, "train_s_per_sample": train_s / trained if trained else None,
        "trained_samples": trained, "sample_s": mean("sample_s"), "reward_s": mean("reward_s"),
        "train_s": mean("train_s"), "iter_s": mean("iter_s"), "wall_s": train[-1]["wall_s"] if train else 0.0,
        "backward_items": sum(r.get("backward_items", 0) for r in train),
        "curve": [{"iteration": r["iteration"], "updates": r["iteration"] * per_iter, "wall_s": r["wall_s"],
                   "reward": r["reward_mean"], "held_out_reward": r.get("held_out_reward")} for r in evals],
    }


def run_one(q: QualityConfig, variant: str, seed: int) -> dict:
    """Train (or resume, or skip) one run and return its summary."""
    from ..training.config_loader import to_dict
    from ..shapes.trainer import Trainer
    from ..training.core import check_resumable

    cfg = q.train_config(variant, seed)
    out = q.run_dir(variant, seed)
    done = out / "result.json"
    if done.is_file():
        result = json.loads(done.read_text())
        if result.get("iterations") == cfg.grpo.iterations:
            if "config" in result:                                      # a finished run of another config
                try:
                    check_resumable(result["config"], to_dict(cfg))
                except ValueError as e:
                    raise ValueError(f"{done} was trained with another config ({e}); use another --out") from None
            result.setdefault("jagg_frac", cfg.estimator.jagg_frac)   # result files of older versions
            result.setdefault("limit", routed_limit(cfg))
            print(f"quality: {variant} seed {seed}: already done ({done}), skipped", flush=True)
            return result
    print(f"quality: {variant} seed {seed}: training {cfg.grpo.iterations} iterations into {out}", flush=True)
    records = Trainer(cfg, resume=True).train()
    if not records or max(r["iteration"] for r in records) < cfg.grpo.iterations:
        raise RuntimeError(f"run {out} stopped before iteration {cfg.grpo.iterations}; rerun to resume it")
    result = {**summarize(records, cfg, variant, seed), "config": to_dict(cfg)}
    write_json(done, result)
    return result


# ----------------------------------------------------------------------------- aggregation and plot


def _stat(xs: list, fn) -> float | None:
    xs = [x for x in xs if x is not None]
    return fn(xs) if xs else None


def aggregate(runs: list[dict]) -> list[dict]:
    """Per variant: final reward mean/std/min/max over seeds, times, and ratios against ``exact``."""
    by = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)
    out = []
    for v, rs in by.items():
        fin = [r["final_reward"] for r in rs]
        out.append({
            "kind": "variant", "variant": v, "seeds": len(rs), "window": rs[0]["window"],
            "intermediate": rs[0]["intermediate"], "mode": rs[0]["mode"], "trained_steps": rs[0]["trained_steps"],
            "updates": rs[0]["updates"],
            "final_reward_mean": _stat(fin, statistics.fmean),
            "final_reward_std": _stat(fin, lambda x: statistics.pstdev(x) if len(x) > 1 else 0.0),
            "final_reward_min": _stat(fin, min), "final_reward_max": _stat(fin, max),
            "final_held_out_mean": _stat([r["final_held_out_reward"] for r in rs], statistics.fmean),
            "train_s_total": statistics.fmean(r["train_s_total"] for r in rs),
            "train_s_per_sample": _stat([r["train_s_per_sample"] for r in rs], statistics.fmean),
            "sample_s": statistics.fmean(r["sample_s"] for r in rs),
            "reward_s": statistics.fmean(r["reward_s"] for r in rs),
            "train_s": statistics.fmean(r["train_s"] for r in rs),
            "iter_s": statistics.fmean(r["iter_s"] for r in rs),
            "limit": rs[0]["limit"],                      # the cost model (1 for exact), from the run summary
        })
    ex = next((a for a in out if a["variant"] == "exact"), None)
    for a in out:
        if ex is None:
            continue
        ratio = lambda k: ex[k] / a[k] if ex.get(k) and a.get(k) else None
        a["train_ratio"] = ratio("train_s")                       # exact / this, training phase per iteration
        a["train_ratio_per_sample"] = ratio("train_s_per_sample")
        a["iter_ratio"] = ratio("iter_s")
        sr = ex["sample_s"] + ex["reward_s"]
        a["iter_ratio_ideal"] = (sr + ex["train_s"]) / (sr + ex["train_s"] / a["limit"])
    return out


def plot(runs: list[dict], path: Path) -> None:
    """Two panels: held-out reward vs optimizer updates and vs wall-clock (mean over seeds, min-max band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    by = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)
    for v, rs in by.items():
        n = min(len(r["curve"]) for r in rs)
        if n == 0:
            continue
        rew = np.array([[p["reward"] for p in r["curve"][:n]] for r in rs])
        upd = np.array([p["updates"] for p in rs[0]["curve"][:n]])
        wall = np.array([[p["wall_s"] for p in r["curve"][:n]] for r in rs]).mean(0)
        for ax, x in zip(axes, (upd, wall)):
            line, = ax.plot(x, rew.mean(0), "o-", ms=3, label=f"{v} ({len(rs)} seeds)")
            if len(rs) > 1:
                ax.fill_between(x, rew.min(0), rew.max(0), color=line.get_color(), alpha=0.2)
    axes[0].set_xlabel("optimizer updates")
    axes[1].set_xlabel("wall-clock of training iterations (s, mean over seeds)")
    for ax in axes:
        ax.set_ylabel("test reward (held-out prompts)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("GRPO on the shapes world: exact vs JAGG (mean over seeds, band = min-max)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


RUN_COLUMNS = [("variant", "variant", ""), ("seed", "seed", ""), ("updates", "updates", ""),
               ("final_reward", "final reward", ".3f"), ("final_held_out_reward", "held-out combos", ".3f"),
               ("train_s_total", "train s total", ".1f"), ("iter_s", "iter s", ".2f"), ("wall_s", "wall s", ".1f"),
               ("backward_items", "bwd rows", "")]
VARIANT_COLUMNS = [("variant", "variant", ""), ("seeds", "seeds", ""), ("final_reward_mean", "final reward", ".3f"),
                   ("final_reward_std", "± std", ".3f"), ("final_reward_min", "min", ".3f"),
                   ("final_reward_max", "max", ".3f"), ("train_s_total", "train s total", ".1f"),
                   ("iter_s", "iter s", ".2f"), ("train_ratio", "train ratio", ".2f"), ("limit", "limit", ".2f"),
                   ("iter_ratio", "iter ratio", ".2f"), ("iter_ratio_ideal", "ideal", ".2f")]


def run_quality(q: QualityConfig) -> list[dict]:
    # seed-major: exact, jagg_fresh, jagg_interp, exact, ... so a slow or busy stretch of the machine hits every
    # variant alike (each run still takes its own wall-clock; compare medians over seeds)
    runs = [run_one(q, v, s) for s in q.seeds for v in q.variants]
    return runs + aggregate(runs)


# ----------------------------------------------------------------------------- command line


def _run(args: argparse.Namespace) -> int:
    sets = (QUICK_SETS if args.quick else []) + list(args.set or [])
    if args.iterations is not None:
        sets.append(f"grpo.iterations={args.iterations}")
    if args.eval_every is not None:
        sets.append(f"eval.every={args.eval_every}")
    n_seeds = args.seeds if args.seeds is not None else (1 if args.quick else 3)
    out = args.out or ("runs/bench_quality_quick" if args.quick else "runs/bench_quality")
    q = QualityConfig(config=args.config, sets=sets, variants=args.variants or list(VARIANTS),
                      seeds=list(range(args.first_seed, args.first_seed + n_seeds)), out=out)
    records = run_quality(q)
    runs = [r for r in records if r["kind"] == "run"]
    variants = [r for r in records if r["kind"] == "variant"]
    print("\nruns")
    print(table(runs, RUN_COLUMNS))
    print("\nper variant (ratios are exact / variant; ideal: sampling and rewards unchanged, training / limit)")
    print(table(variants, VARIANT_COLUMNS))
    png = Path(args.plot or Path(out) / "quality.png")
    plot(runs, png)
    print(f"\nwrote {png}")
    json_path = args.json or Path(out) / "quality.json"
    write_json(json_path, records)
    print(f"wrote {json_path}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("quality", help="GRPO runs exact vs JAGG x seeds: reward vs updates and wall-clock",
                       description=__doc__.replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=default_config_path(),
                   help="trainer YAML shared by every run [default: configs/default.yaml when present]")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a trainer config key for every run (repeatable), e.g. estimator.window=8")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), help=f"[default: {' '.join(VARIANTS)}]")
    p.add_argument("--seeds", type=int, help="seeds per variant [default: 3; 1 with --quick]")
    p.add_argument("--first-seed", type=int, default=0, help="seeds are first-seed .. first-seed + seeds - 1")
    p.add_argument("--iterations", type=int, help="GRPO iterations per run [default: the config's grpo.iterations]")
    p.add_argument("--eval-every", type=int, help="evaluate every N iterations [default: 10]")
    p.add_argument("--out", help="bench output dir, one sub-dir per run [default: runs/bench_quality]")
    p.add_argument("--plot", help="PNG path [default: OUT/quality.png]")
    p.add_argument("--json", help="JSON path [default: OUT/quality.json]")
    p.add_argument("--quick", action="store_true",
                   help=f"a tiny smoke version, 1 seed, into runs/bench_quality_quick: {' '.join(QUICK_SETS)}")
    p.set_defaults(func=_run)
