"""``jagg bench quality``: does a JAGG variant reach a given reward sooner than exact? Paired GRPO runs x seeds.

Every variant trains with :class:`jagg.trainers.shapes.ShapesTrainer` from the same config (the main job plus ``--set``),
for the same iterations and optimizer updates, once per seed. Seeds are paired across variants: a seed fixes the
prompts and the noise streams (the unbiased correction's picks use an RNG of their own), so the variants of one seed
differ only by their gradients. The runs alternate (seed 0 of every variant, then seed 1, ...), so a busy stretch of
the machine hits every variant alike. Each run writes ``OUT/<variant>/seed<k>/`` (the trainer's outputs) and, once
finished, ``result.json``; a finished run of the same config is skipped and an unfinished one resumes, so the
benchmark can be interrupted and restarted.

A variant is ``NAME`` (built in: ``exact``, ``config`` = the config's own estimator, ``jagg_fresh``,
``jagg_interp``) or ``NAME:KEY=VALUE,KEY=VALUE`` (estimator keys on top of ``mode=jagg``; ``estimator.`` may be left
out), e.g. ``unbiased:knots=shared,window=5,correction_p=0.25``; every name once, and a defined one not a built-in
name. ``exact`` is always run: it is the reference. Ctrl-C (or SIGTERM) finishes the running iteration, saves and
exits 130 without a result for that run or a comparison; the same command continues it.

Reported (95% intervals by bootstrap over seeds, 2000 resamples, seed 0 of numpy):
- **time to target**: the target is exact's final training reward (the mean over its last 10% of iterations, mean
  over seeds); a variant reaches it at the first iteration where its seed-averaged training reward, smoothed by a
  trailing mean over 10% of the iterations, is at or above it. Time is the wall-clock of training iterations (the
  trainer's ``wall_s``: sampling, reward and training; evaluation and audit excluded), averaged over seeds. The
  ratio exact / variant > 1 means the variant gets there sooner. ``--clock cpu`` uses the training process's CPU
  seconds instead (the trainer's ``cpu_s``: waiting for a busy core does not count, a core slowed by its neighbour
  still does); ``--clock iterations`` counts updates (updates-to-target; times the side-by-side iteration-time ratio
  of ``jagg bench e2e`` it estimates the time ratio without the load of the machine in it). A variant that never gets there counts as reaching
  it at its last iteration (an upper bound of its ratio); the share of such resamples is reported.
- ``--target test``: the same with exact's final *held-out* test reward as the target (mean over seeds of the last
  evaluation), reached where the seed-mean test curve first crosses it (linear between evaluations). Always reported
  too: the updates-to-target ratio with its interval, and ``time_ratio_estimate`` = updates-to-target ratio times the
  CPU-seconds iteration ratio of the same runs (the load of the machine taken out), and the held-out gain of each
  variant over its start (``test_gain``, with its interval). Also the measured counterpart of ``jagg bench
  efficiency``'s prediction, defined for a variant that does not reach exact's final reward too:
  ``measured_efficiency`` = the updates exact needs to reach the highest held-out reward both reach (the lower of the
  two seed-mean final rewards) over the updates the variant needs, with its interval, and
  ``measured_time_efficiency`` = that times the CPU-seconds iteration ratio (compare ``adam_time_efficiency``).
- **final test reward** at equal updates (held-out test prompts, the trainer's last evaluation), its mean, interval,
  the paired difference to exact with its interval, and the evaluation's own noise (per-image standard error).
- the training reward at the start and the end (means over the first and last 10% of iterations): a variant that
  ends below its start has drifted.
- backward rows per update, the iteration-time ratio exact / variant, and its ideal: sampling and reward as exact's,
  training scaled by the cost model (``B = 2F``) applied to the measured rows (``3 rows_exact / (3 rows + nograd)``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..checks import SEED_MAX, check_output_file, check_seed, check_unique_names, number_arg, parse_spec
from ..trainers.shapes import ShapesTrainer
from ..trainers.shapes_config import ShapesTrainConfig
from ..training import config_loader as configuration
from ..training.atomic import atomic_write
from ..training.rundir import RunHints
from .common import default_config_path, table, write_json
from .projection import CostStructure, add_cost_arguments, job_structure, resolve

BUILTIN = {
    "exact": ["estimator.mode=exact"],
    "config": [],
    "jagg_fresh": ["estimator.mode=jagg", "estimator.intermediate=fresh"],
    "jagg_interp": ["estimator.mode=jagg", "estimator.intermediate=interp"],
}
# bench defaults, before the user's --set (which win)
DEFAULT_SETS = ["log.progress=false", "log.tensorboard=false", "log.checkpoint_every=50"]
QUICK_SETS = ["grpo.iterations=4", "sample.prompts_per_iter=4", "sample.group_size=4", "eval.every=2",
              "eval.num_prompts=8", "eval.images_per_prompt=1", "eval.grid_size=4", "log.checkpoint_every=0"]
BOOTSTRAP = 2000
CLOCKS = ("wall", "cpu", "iterations")
TARGETS = ("train", "test")
TRAIN_CURVE = ("iterations", "wall", "reward", "cpu")    # the columns of a run's train_curve (its result.json)
TEST_CURVE = ("iterations", "wall", "reward")            # ... and of its test_curve, one row per evaluation
# what a run's result keeps of its last audit record (estimator.audit_every > 0): the meter's final prediction
METER = ("audits", "error_to_noise", "bias_to_noise", "bias_to_noise_se", "bias_z", "rows_ratio",
         "predicted_efficiency", "predicted_time_efficiency", "predicted_adam_efficiency",
         "predicted_adam_time_efficiency", "predicted_adam_tensor_efficiency", "predicted_adam_tensor_time_efficiency")


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """``NAME`` (built in) or ``NAME:KEY=VALUE,...`` -> ``(name, --set strings)``; estimator keys may be short."""
    name, _, body = spec.partition(":")
    if not name or any(c in name for c in "/ =,"):
        raise ValueError(f"--variant {spec!r}: the name must be a word (no '/', ' ', '=' or ','), e.g. unbiased:"
                         "correction_p=0.25")
    if not body:
        if name not in BUILTIN:
            raise ValueError(f"--variant {spec!r}: unknown built-in variant; built in: {sorted(BUILTIN)}, or give "
                             "NAME:KEY=VALUE,...")
        return name, list(BUILTIN[name])
    check_unique_names([spec], BUILTIN, "--variant")
    sets = [f"{key if '.' in key else 'estimator.' + key}={value}"
            for key, value in parse_spec(spec, "--variant")[1].items()]
    return name, ["estimator.mode=jagg"] + sets


def parse_variants(specs: list[str]) -> dict[str, list[str]]:
    """``--variant`` specs -> ``{name: --set strings}`` (:func:`parse_variant`); every name once
    (:func:`jagg.checks.check_unique_names`)."""
    check_unique_names(specs, BUILTIN, "--variant")
    return dict(parse_variant(s) for s in specs)


@dataclass
class QualityConfig:
    config: str | None = None                 # trainer YAML
    sets: list[str] = field(default_factory=list)
    variants: dict[str, list[str]] = field(default_factory=lambda: {"exact": BUILTIN["exact"],
                                                                    "config": BUILTIN["config"]})
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    out: str = "runs/bench_quality"

    def __post_init__(self):
        if not self.seeds:
            raise ValueError("--seeds must be >= 1")
        for seed in self.seeds:
            check_seed(seed, "every seed (--first-seed .. --first-seed + --seeds - 1)")
        if not str(self.out).strip():
            raise ValueError("--out is empty; give the bench's output directory")
        if "exact" not in self.variants:
            self.variants = {"exact": BUILTIN["exact"], **self.variants}

    def train_config(self, variant: str, seed: int) -> ShapesTrainConfig:
        run = [f"seed={seed}", f"log.output_dir={self.run_dir(variant, seed)}"]
        try:
            return configuration.load(ShapesTrainConfig, self.config, DEFAULT_SETS + self.sets + self.variants[variant] + run)
        except ValueError as e:
            raise ValueError(f"variant {variant!r}: {e}") from None

    def run_dir(self, variant: str, seed: int) -> Path:
        return Path(self.out) / variant / f"seed{seed}"


# ----------------------------------------------------------------------------- runs


def summarize(records: list[dict], cfg: ShapesTrainConfig, variant: str, seed: int) -> dict:
    """One run's result from its metrics records."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    audits = [r for r in records if r.get("kind") == "audit"]
    per_iter = cfg.grpo.inner_epochs * cfg.grpo.updates_per_epoch
    med = lambda k: statistics.median(r[k] for r in train) if train else float("nan")
    updates = len(train) * per_iter
    n_eval = cfg.eval.num_prompts or None
    last = evals[-1] if evals else {}
    return {
        "kind": "run", "variant": variant, "seed": seed, "estimator": cfg.estimator.to_dict(),
        "iterations": cfg.grpo.iterations, "updates": updates,
        "final_test_reward": last.get("reward_mean"), "final_test_reward_std": last.get("reward_std"),
        "eval_images": (n_eval or _num_test_prompts()) * cfg.eval.images_per_prompt,
        "final_held_out_reward": last.get("held_out_reward"),
        "sample_s": med("sample_s"), "reward_s": med("reward_s"), "train_s": med("train_s"), "iter_s": med("iter_s"),
        "iter_cpu_s": med("iter_cpu_s"),
        "wall_s": train[-1]["wall_s"] if train else 0.0,
        "rows_per_update": sum(r.get("backward_items", 0) for r in train) / max(updates, 1),
        "nograd_per_update": sum(r.get("forward_nograd_items", 0) for r in train) / max(updates, 1),
        "meter": {k: audits[-1].get(k) for k in METER} if audits else None,
        "correction_p": train[-1].get("correction_p") if train else None,           # the last rate (auto: chosen)
        "train_curve": [[r["iteration"], r["wall_s"], r["reward_mean"], r.get("cpu_s")] for r in train],   # TRAIN_CURVE
        "test_curve": [[r["iteration"], r["wall_s"], r["reward_mean"]] for r in evals],                    # TEST_CURVE
    }


def _num_test_prompts() -> int:
    from ..shapes import test_prompts

    return len(test_prompts())


# what the runs' refusals and notes tell the user to do: the bench has no --resume and keeps its runs in --out
HINTS = RunHints(continue_run="rerun the same jagg bench quality command to continue", other_dir="use another --out",
                 start_over="move that run directory away and rerun")


class QualityRun(ShapesTrainer):
    """One run of the bench: the shapes trainer in the bench's words (:data:`HINTS`), whose stop on SIGINT/SIGTERM
    (the iteration finished and saved) is the bench's interruption: a ``KeyboardInterrupt``, so that no result is
    written as if the run were complete, even when the signal came in its last iteration."""

    hints = HINTS

    def train(self) -> list[dict]:
        records = super().train()
        if self.stopped:
            raise KeyboardInterrupt(f"{self.out} saved at iteration {self.iteration}; {HINTS.continue_run}")
        return records


def run_one(q: QualityConfig, variant: str, seed: int) -> dict:
    """Train (or resume, or skip) one run and return its summary."""
    from ..training.config_loader import to_dict
    from ..trainers.base import check_resumable

    cfg = q.train_config(variant, seed)
    out = q.run_dir(variant, seed)
    done = out / "result.json"
    if done.is_file():
        try:
            result = json.loads(done.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{done} cannot be read ({' '.join(str(e).split())}); delete it (the run's checkpoints "
                             "stay, and the run is summarized again)") from None
        if result.get("iterations") == cfg.grpo.iterations and "train_curve" in result:
            try:
                check_resumable(result["config"], to_dict(cfg))
            except (KeyError, ValueError) as e:
                raise ValueError(f"{done} was trained with another config ({e}); use another --out") from None
            print(f"quality: {variant} seed {seed}: already done ({done}), skipped", flush=True)
            return {**result, "variant": variant}          # its directory is this variant's (even if renamed)
    print(f"quality: {variant} seed {seed}: training {cfg.grpo.iterations} iterations into {out}", flush=True)
    try:
        records = QualityRun.run(cfg, resume=True)
    except ValueError as e:                   # any refusal of the run (its directory, its config): named by it
        raise ValueError(f"run {out}: {e}") from None
    result = {**summarize(records, cfg, variant, seed), "config": to_dict(cfg)}
    write_json(done, result)
    return result


# ----------------------------------------------------------------------------- statistics


def smooth(x: np.ndarray, w: int) -> np.ndarray:
    """Trailing mean over ``w`` entries along the last axis (shorter at the start)."""
    c = np.cumsum(np.pad(x, [(0, 0)] * (x.ndim - 1) + [(1, 0)]), axis=-1)
    n = np.arange(1, x.shape[-1] + 1)
    lo = np.maximum(n - w, 0)
    return (c[..., n] - c[..., lo]) / (n - lo)


def time_to_target(reward: np.ndarray, wall: np.ndarray, target: float, w: int) -> tuple[float, bool]:
    """Seconds until the seed-mean of ``reward`` ``[S, N]``, smoothed over ``w`` iterations, first reaches ``target``
    (wall-clock ``[S, N]`` averaged over seeds), and whether it did (else: the last iteration's time)."""
    curve, t = smooth(reward.mean(0), w), wall.mean(0)
    hit = np.nonzero(curve >= target - 1e-12)[0]
    return (float(t[hit[0]]), True) if hit.size else (float(t[-1]), False)


def time_to_test_target(test: np.ndarray, clock: np.ndarray, target: float) -> tuple[float, bool]:
    """When the seed-mean held-out reward ``test`` ``[S, M]`` (evaluations at the times ``clock`` ``[S, M]``, averaged
    over seeds) first reaches ``target``, linearly interpolated between the two evaluations around the crossing;
    and whether it did (else: the last evaluation's time)."""
    curve, t = test.mean(0), clock.mean(0)
    hit = np.nonzero(curve >= target - 1e-12)[0]
    if not hit.size:
        return float(t[-1]), False
    i = int(hit[0])
    if i == 0:
        return float(t[0]), True
    frac = (target - curve[i - 1]) / (curve[i] - curve[i - 1])
    return float(t[i - 1] + frac * (t[i] - t[i - 1])), True


def _interval(xs) -> tuple[float, float]:
    """The 95% percentile interval of the defined (non-NaN) resamples; NaN when none is defined. A time ratio is
    undefined in a resample whose target the variants already meet at the start (0 / 0)."""
    xs = np.asarray(xs, dtype=float)
    if np.isnan(xs).all():
        return float("nan"), float("nan")
    return float(np.nanpercentile(xs, 2.5)), float(np.nanpercentile(xs, 97.5))


@dataclass
class Curves:
    """One variant's runs over the seeds (``S`` of them), cut to the iterations (``n``) and evaluations (``m``) that
    every run of the comparison has.

    Attributes:
        reward: ``[S, n]`` training reward per iteration.
        clock: per clock of :data:`CLOCKS`, ``[S, n]`` its reading at each iteration.
        test: ``[S, m]`` held-out reward per evaluation.
        test_clock: per clock, ``[S, m]`` its reading at each evaluation (0 at the evaluation before training).
        final: ``[S]`` the final held-out reward (NaN for a run without one).
    """

    reward: np.ndarray
    clock: dict[str, np.ndarray]
    test: np.ndarray
    test_clock: dict[str, np.ndarray]
    final: np.ndarray


def _at_evaluations(run: dict, clock: str) -> list[float]:
    """The ``clock`` reading of a run at each of its evaluations (its train curve at the evaluation's iteration)."""
    col, it = TRAIN_CURVE.index(clock), TRAIN_CURVE.index("iterations")
    at = {p[it]: p[col] for p in run["train_curve"]}
    return [0.0 if p[it] == 0 else float(at.get(p[it], np.nan)) for p in run["test_curve"]]


def curves(runs: list[dict], n: int, m: int) -> Curves:
    """:class:`Curves` of one variant's ``runs`` (seed after seed), cut to ``n`` iterations and ``m`` evaluations."""
    column = lambda name: [[p[TRAIN_CURVE.index(name)] for p in r["train_curve"][:n]] for r in runs]
    return Curves(
        reward=np.array(column("reward")),
        clock={c: np.array(column(c), dtype=float) for c in CLOCKS},
        test=np.array([[p[TEST_CURVE.index("reward")] for p in r["test_curve"][:m]] for r in runs]),
        test_clock={c: np.array([_at_evaluations(r, c)[:m] for r in runs]) for c in CLOCKS},
        final=np.array([np.nan if r["final_test_reward"] is None else r["final_test_reward"] for r in runs]))


@dataclass
class Pair:
    """A variant's :class:`Curves` beside exact's, and how to compare them: the ``clock`` of time-to-target, its
    ``target`` (``train`` or ``test``) and the trailing mean's ``w`` iterations."""

    exact: Curves
    variant: Curves
    clock: str
    target: str
    w: int

    def time_to_target_ratio(self, idx: np.ndarray, clock: str | None = None) -> tuple[float, bool]:
        """Exact's time to its own final reward over the variant's, on the seeds ``idx`` (a bootstrap resample), and
        whether the variant reached it (where it did not, the ratio is an upper bound)."""
        c = clock or self.clock
        ex, v = self.exact, self.variant
        if self.target == "test":
            goal = float(ex.test[idx][:, -1].mean())
            t_ex, _ = time_to_test_target(ex.test[idx], ex.test_clock[c][idx], goal)
            t_v, reached = time_to_test_target(v.test[idx], v.test_clock[c][idx], goal)
            return (t_ex / t_v if t_v > 0 else float("nan")), reached
        goal = float(ex.reward[idx][:, -self.w:].mean())
        t_ex, _ = time_to_target(ex.reward[idx], ex.clock[c][idx], goal, self.w)
        t_v, reached = time_to_target(v.reward[idx], v.clock[c][idx], goal, self.w)
        return t_ex / t_v, reached

    def common_level_ratio(self, idx: np.ndarray) -> float:
        """Updates exact needs to reach the lower of the two seed-mean final held-out rewards / the variant's."""
        ex, v = self.exact, self.variant
        if ex.test.shape[1] < 2:
            return float("nan")
        level = min(float(ex.test[idx][:, -1].mean()), float(v.test[idx][:, -1].mean()))
        u_ex, _ = time_to_test_target(ex.test[idx], ex.test_clock["iterations"][idx], level)
        u_v, _ = time_to_test_target(v.test[idx], v.test_clock["iterations"][idx], level)
        return u_ex / u_v if u_v > 0 and u_ex > 0 else float("nan")


def _median(runs: list[dict], key: str) -> float:
    """The median of ``key`` over runs (a run without it counts as NaN)."""
    return statistics.median(r.get(key) or np.nan for r in runs)


def _costs(exact_runs: list[dict], runs: list[dict]) -> dict:
    """Rows and seconds per update and iteration (medians over seeds), their ratios to exact's, and the ideal
    iteration ratio of the module docstring."""
    ex = {k: statistics.median(r[k] for r in exact_runs)
          for k in ("sample_s", "reward_s", "train_s", "iter_s", "rows_per_update")}
    rows = statistics.median(r["rows_per_update"] for r in runs)
    nograd = statistics.median(r["nograd_per_update"] for r in runs)
    iter_s = statistics.median(r["iter_s"] for r in runs)
    limit = 3 * ex["rows_per_update"] / (3 * rows + nograd) if rows else float("nan")
    sr = ex["sample_s"] + ex["reward_s"]
    return {"rows_per_update": rows, "nograd_per_update": nograd, "iter_s": iter_s,
            "train_s": statistics.median(r["train_s"] for r in runs), "iter_ratio": ex["iter_s"] / iter_s,
            "limit": limit, "iter_cpu_ratio": _median(exact_runs, "iter_cpu_s") / _median(runs, "iter_cpu_s"),
            "iter_ratio_ideal": (sr + ex["train_s"]) / (sr + ex["train_s"] / limit),
            "wall_s": statistics.fmean(r["wall_s"] for r in runs)}


def _time_to_target(pair: Pair, boots: list[np.ndarray]) -> dict:
    """Time to exact's final reward, exact / variant, on all seeds, with its interval over the resamples ``boots``."""
    ratio, reached = pair.time_to_target_ratio(np.arange(pair.exact.reward.shape[0]))
    bt = [pair.time_to_target_ratio(idx) for idx in boots]
    lo, hi = _interval([b[0] for b in bt])
    return {"time_to_target_ratio": ratio, "reached": reached, "ratio_lo": lo, "ratio_hi": hi,
            "not_reached_share": float(np.mean([not b[1] for b in bt])),
            "undefined_share": float(np.mean([math.isnan(b[0]) for b in bt]))}


def _final_rewards(pair: Pair, boots: list[np.ndarray], runs: list[dict]) -> dict:
    """The final held-out reward at equal updates, its paired difference to exact's and the evaluation's noise; the
    training reward at the start and at the end."""
    v, w = pair.variant, pair.w
    fin, diff = v.final, v.final - pair.exact.final
    fin_lo, fin_hi = _interval([float(np.nanmean(fin[idx])) for idx in boots])
    diff_lo, diff_hi = _interval([float(np.nanmean(diff[idx])) for idx in boots])
    sd = [r["final_test_reward_std"] for r in runs if r["final_test_reward_std"] is not None]
    return {"final_test_mean": float(np.nanmean(fin)), "final_test_lo": fin_lo, "final_test_hi": fin_hi,
            "diff_vs_exact": float(np.nanmean(diff)), "diff_lo": diff_lo, "diff_hi": diff_hi,
            "eval_se": statistics.fmean(sd) / np.sqrt(runs[0]["eval_images"]) if sd else None,
            "train_start": float(v.reward[:, :w].mean()), "train_end": float(v.reward[:, -w:].mean())}


def _per_update(pair: Pair, boots: list[np.ndarray], cpu_ratio: float) -> dict:
    """Updates to target with its interval, the time ratio they and the CPU-seconds iteration ratio estimate, the
    measured efficiency at the level both reach, and the held-out gain over the start."""
    S, v = pair.exact.reward.shape[0], pair.variant
    updates = pair.time_to_target_ratio(np.arange(S), "iterations")[0]
    ups_lo, ups_hi = _interval([pair.time_to_target_ratio(idx, "iterations")[0] for idx in boots])
    eff_lo, eff_hi = _interval([pair.common_level_ratio(idx) for idx in boots])
    rec = {"target": pair.target, "updates_to_target_ratio": updates, "updates_ratio_lo": ups_lo,
           "updates_ratio_hi": ups_hi,
           # updates-to-target times the CPU-seconds iteration ratio measured in the same runs
           "time_ratio_estimate": updates * cpu_ratio, "time_ratio_estimate_lo": ups_lo * cpu_ratio,
           "time_ratio_estimate_hi": ups_hi * cpu_ratio, "measured_efficiency": pair.common_level_ratio(np.arange(S)),
           "measured_efficiency_lo": eff_lo, "measured_efficiency_hi": eff_hi}
    if v.test.shape[1]:
        gain = v.final - v.test[:, 0]
        rec.update({"test_start": float(np.nanmean(v.test[:, 0])), "test_gain": float(np.nanmean(gain))})
        rec["test_gain_lo"], rec["test_gain_hi"] = _interval([float(np.nanmean(gain[idx])) for idx in boots])
    else:
        rec.update(dict.fromkeys(("test_start", "test_gain", "test_gain_lo", "test_gain_hi")))
    for k in ("", "_lo", "_hi"):
        rec[f"measured_time_efficiency{k}"] = rec[f"measured_efficiency{k}"] * cpu_ratio
    return rec


def _meter(runs: list[dict]) -> dict:
    """The meter's final prediction (each run's last audit) as medians over the seeds: per update
    (``meter_efficiency`` under SGD's model, ``meter_adam_efficiency``, ``meter_adam_tensor_efficiency``: the
    predicted efficiencies over the rows ratio, to set beside ``measured_efficiency``), per CPU second
    (``meter_adam_time_efficiency``, beside ``measured_time_efficiency``), ``meter_bias_z``, ``meter_audits``, and the
    last correction rate (``correction_p``: the one ``auto`` chose). NaN without audits."""
    def med(values) -> float:
        values = [v for v in values if v is not None and math.isfinite(v)]
        return statistics.median(values) if values else math.nan

    meters = [r["meter"] for r in runs if r.get("meter")]
    per_update = lambda key: med(m[key] / m["rows_ratio"] for m in meters
                                 if m.get(key) is not None and m.get("rows_ratio"))
    return {"meter_efficiency": per_update("predicted_efficiency"),
            "meter_adam_efficiency": per_update("predicted_adam_efficiency"),
            "meter_adam_tensor_efficiency": per_update("predicted_adam_tensor_efficiency"),
            "meter_adam_time_efficiency": med(m.get("predicted_adam_time_efficiency") for m in meters),
            "meter_bias_z": med(m.get("bias_z") for m in meters), "meter_audits": med(m.get("audits") for m in meters),
            "correction_p": med(r.get("correction_p") for r in runs)}


def _projected(rec: dict, exact: dict, cost: CostStructure) -> dict:
    """The iteration ratio ``cost`` projects for the variant's rows and no-grad rows against exact's
    (:meth:`~jagg.bench.projection.CostStructure.iteration_ratio`) and ``projected_time_efficiency`` (with its
    interval) = ``measured_efficiency`` x that ratio."""
    rows = exact["rows_per_update"]
    ratio = cost.iteration_ratio(rec["rows_per_update"] / rows, (rec["nograd_per_update"] - exact["nograd_per_update"])
                                 / rows) if rows else math.nan
    return {"projected_iter_ratio": ratio,
            **{f"projected_time_efficiency{k}": rec[f"measured_efficiency{k}"] * ratio for k in ("", "_lo", "_hi")}}


def compare(runs: list[dict], variants: list[str], seeds: list[int], clock: str = "wall",
            target: str = "train", cost: CostStructure | None = None) -> list[dict]:
    """Per variant: the paired statistics of the module docstring (bootstrap over seeds). ``clock``: ``wall``
    (wall-clock seconds), ``cpu`` (CPU seconds of the training process) or ``iterations`` for the time axis;
    ``target``: ``train`` (exact's final training reward) or ``test`` (exact's final held-out reward); ``cost``: the
    cost structure of the projected columns (None: none)."""
    if clock not in CLOCKS:
        raise ValueError(f"--clock must be one of {CLOCKS}; got {clock!r}")
    if target not in TARGETS:
        raise ValueError(f"--target must be one of {TARGETS}; got {target!r}")
    by_key = {(r["variant"], r["seed"]): r for r in runs}
    by = {v: [by_key[(v, s)] for s in seeds] for v in variants}
    n = min(len(r["train_curve"]) for rs in by.values() for r in rs)
    m = min(len(r["test_curve"]) for rs in by.values() for r in rs)
    if target == "test" and m < 2:
        raise ValueError("--target test needs at least two evaluations per run (eval.every > 0)")
    w = max(1, n // 10)
    cur = {v: curves(rs, n, m) for v, rs in by.items()}
    rng = np.random.default_rng(0)
    S = len(seeds)
    boots = [rng.integers(0, S, S) for _ in range(BOOTSTRAP)] if S > 1 else [np.arange(S)]
    out = []
    for v in variants:
        pair = Pair(cur["exact"], cur[v], clock, target, w)
        costs = _costs(by["exact"], by[v])
        out.append({"kind": "variant", "variant": v, "seeds": S, "iterations": n, "smooth_iterations": w,
                    "updates": by[v][0]["updates"], **_time_to_target(pair, boots),
                    **_final_rewards(pair, boots, by[v]), **costs, "clock": clock,
                    **_per_update(pair, boots, costs["iter_cpu_ratio"]), **_meter(by[v])})
    e = out[variants.index("exact")]
    if cost is not None:
        for r in out:
            r.update(_projected(r, e, cost))
    for r in out:
        r["within_exact_interval"] = bool(e["final_test_lo"] <= r["final_test_mean"] <= e["final_test_hi"])
        r["drifted"] = r["train_end"] < r["train_start"]
    return out


# ----------------------------------------------------------------------------- plot


def plot(runs: list[dict], path: Path, title: str = "GRPO on the shapes world", clock: str = "wall") -> None:
    """Two panels against the time of training iterations (``clock``: wall-clock or CPU seconds, mean over seeds):
    the training reward (smoothed trailing mean, 10% of the iterations) and the held-out test reward (band = min-max
    over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)
    for v, rs in by.items():
        n = min(len(r["train_curve"]) for r in rs)
        if n == 0:
            continue
        m = min(len(r["test_curve"]) for r in rs)
        cur = curves(rs, n, m)
        wall = cur.clock[clock].mean(0)
        per_iter = wall[-1] / n                          # test points: at their iteration's time
        line, = axes[0].plot(wall, smooth(cur.reward.mean(0), max(1, n // 10)), label=f"{v} ({len(rs)} seeds)")
        if m:
            at = TEST_CURVE.index("iterations")
            tw = np.array([p[at] for p in rs[0]["test_curve"][:m]], dtype=float) * per_iter
            axes[1].plot(tw, cur.test.mean(0), "o-", ms=3, color=line.get_color(), label=v)
            if len(rs) > 1:
                axes[1].fill_between(tw, cur.test.min(0), cur.test.max(0), color=line.get_color(), alpha=0.15)
    axes[0].set_ylabel("training reward (smoothed)")
    axes[1].set_ylabel("test reward (held-out prompts)")
    for ax in axes:
        ax.set_xlabel({"wall": "wall-clock seconds of training iterations (mean over seeds)",
                       "cpu": "CPU seconds of training iterations (mean over seeds)",
                       "iterations": "iterations (= optimizer updates)"}[clock])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title}: reward against {dict(wall='wall-clock time', cpu='CPU time').get(clock, 'updates')}, "
                 "exact vs JAGG")
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png"))
    plt.close(fig)


VARIANT_COLUMNS = [
    ("variant", "variant", ""), ("seeds", "seeds", ""), ("time_to_target_ratio", "time-to-target", ".2f"),
    ("ratio_lo", "lo", ".2f"), ("ratio_hi", "hi", ".2f"), ("not_reached_share", "unreached", ".2f"),
    ("time_ratio_estimate", "updates x cpu", ".2f"), ("time_ratio_estimate_lo", "lo", ".2f"),
    ("time_ratio_estimate_hi", "hi", ".2f"), ("measured_time_efficiency", "time eff.", ".2f"),
    ("measured_time_efficiency_lo", "lo", ".2f"), ("measured_time_efficiency_hi", "hi", ".2f"),
    ("test_gain", "test gain", "+.3f"),
    ("final_test_mean", "final test", ".3f"), ("final_test_lo", "lo", ".3f"), ("final_test_hi", "hi", ".3f"),
    ("diff_vs_exact", "- exact", "+.3f"), ("diff_lo", "lo", "+.3f"), ("diff_hi", "hi", "+.3f"),
    ("eval_se", "eval SE", ".3f"), ("train_start", "train start", ".3f"), ("train_end", "end", ".3f"),
    ("rows_per_update", "rows/upd", ".0f"), ("iter_ratio", "iter ratio", ".2f"), ("iter_ratio_ideal", "ideal", ".2f")]
METER_COLUMNS = [
    ("variant", "variant", ""), ("measured_efficiency", "per update", ".2f"), ("measured_efficiency_lo", "lo", ".2f"),
    ("measured_efficiency_hi", "hi", ".2f"), ("meter_adam_efficiency", "meter: Adam", ".2f"),
    ("meter_adam_tensor_efficiency", "per tensor", ".2f"), ("meter_efficiency", "SGD", ".2f"),
    ("meter_bias_z", "bias z", ".1f"), ("correction_p", "correction_p", ".3f"),
    ("measured_time_efficiency", "per CPU s", ".2f"), ("meter_adam_time_efficiency", "meter: Adam", ".2f"),
    ("projected_iter_ratio", "projected: iter ratio", ".2f"), ("projected_time_efficiency", "time eff.", ".2f"),
    ("projected_time_efficiency_lo", "lo", ".2f"), ("projected_time_efficiency_hi", "hi", ".2f")]
RUN_COLUMNS = [("variant", "variant", ""), ("seed", "seed", ""), ("updates", "updates", ""),
               ("final_test_reward", "final test", ".3f"), ("iter_s", "iter s", ".2f"), ("wall_s", "wall s", ".0f"),
               ("rows_per_update", "rows/upd", ".0f")]


def run_quality(q: QualityConfig, clock: str = "wall", train_only: str | None = None,
                target: str = "train", cost: CostStructure | None = None) -> list[dict]:
    """Train (or skip, or resume) every run and compare (``cost``: as :func:`compare`). ``train_only``: train just
    that variant's runs and return them without a comparison (to run two variants side by side in two processes,
    which then share whatever else loads the machine; a last call without it compares)."""
    names = list(q.variants)
    for v in names:                                     # every variant's config loads before any run trains
        q.train_config(v, q.seeds[0])
    if train_only is not None:
        if train_only not in names:
            raise ValueError(f"--train-only {train_only!r} is not one of the variants {names}")
        return [run_one(q, train_only, s) for s in q.seeds]
    runs = [run_one(q, v, s) for s in q.seeds for v in names]        # seed-major, alternating variants
    return runs + compare(runs, names, q.seeds, clock, target, cost)


# ----------------------------------------------------------------------------- command line


def _run(args: argparse.Namespace) -> int:
    sets = (QUICK_SETS if args.quick else []) + list(args.set or [])
    if args.iterations is not None:
        sets.append(f"grpo.iterations={args.iterations}")
    if args.eval_every is not None:
        sets.append(f"eval.every={args.eval_every}")
    n_seeds = args.seeds if args.seeds is not None else (2 if args.quick else 5)
    variants = parse_variants(args.variant or ["exact", "config"])
    out = args.out if args.out is not None else ("runs/bench_quality_quick" if args.quick else "runs/bench_quality")
    q = QualityConfig(config=args.config, sets=sets, variants=variants,
                      seeds=list(range(args.first_seed, args.first_seed + n_seeds)), out=out)
    cost, cost_line = resolve(args.cost, job_structure(q.train_config("exact", q.seeds[0]).sample),
                              args.gpu_bench_json)
    png = Path(out) / "quality.png" if args.plot is None else args.plot
    json_path = Path(out) / "quality.json" if args.json is None else args.json
    if args.train_only is None:                         # the comparison's files, checked before any run trains
        check_output_file(png, "--plot", args.overwrite, (".png",))
        check_output_file(json_path, "--json", args.overwrite)
    records = run_quality(q, args.clock, args.train_only, args.target, cost)
    runs = [r for r in records if r["kind"] == "run"]
    if args.train_only is not None:
        print(table(runs, RUN_COLUMNS))
        print("trained; run the same command without --train-only to compare the variants")
        return 0
    summary = [r for r in records if r["kind"] == "variant"]
    print("\nruns")
    print(table(runs, RUN_COLUMNS))
    print(f"\nper variant, paired over seeds {q.seeds[0]}..{q.seeds[-1]} (95% bootstrap intervals; time-to-target and "
          "iteration ratios are exact / variant)")
    print(table(summary, VARIANT_COLUMNS))
    print("\nthe efficiency at the held-out level both reach, measured, beside the meter's final prediction (the "
          "runs' last audit, with estimator.audit_every; median over seeds) and, projected, not measured: the "
          f"measured per-update efficiency times the iteration ratio of {cost_line}")
    print(table(summary, METER_COLUMNS))
    for r in summary:
        r["cost_structure"] = cost_line
    plot(runs, Path(png), clock=args.clock)
    print(f"\nwrote {png}")
    write_json(json_path, records)
    print(f"wrote {json_path}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("quality", help="paired GRPO runs exact vs JAGG variants x seeds: time to reward, final reward",
                       description=__doc__.replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=default_config_path(),
                   help="trainer YAML shared by every run [default: the main job]")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a trainer config key for every run (repeatable), e.g. grpo.iterations=200")
    p.add_argument("--variant", action="append", metavar="NAME[:KEY=VALUE,...]",
                   help="a variant (repeatable): exact, config, jagg_fresh, jagg_interp, or NAME:KEY=VALUE,... of "
                        "estimator keys (a name of its own: each name once) [default: exact config]")
    p.add_argument("--seeds", type=number_arg(int, 1), help="paired seeds per variant [default: 5; 2 with --quick]")
    p.add_argument("--first-seed", type=number_arg(int, seed=True), default=0,
                   help=f"seeds are first-seed .. first-seed + seeds - 1, each at most {SEED_MAX}")
    p.add_argument("--iterations", type=number_arg(int, 1),
                   help="GRPO iterations per run [default: the config's grpo.iterations]")
    p.add_argument("--eval-every", type=number_arg(int, 0),
                   help="evaluate every N iterations [default: the config's eval.every]")
    p.add_argument("--clock", choices=CLOCKS, default="wall",
                   help="time axis of time-to-target: wall-clock seconds, CPU seconds of the training process (with "
                        "threads=1 the two agree on an idle machine; CPU seconds ignore waiting for a busy core, not "
                        "a slower one), or iterations (updates to target: multiply by the iteration-time ratio of "
                        "`jagg bench e2e` for a load-independent time estimate) [default: wall]")
    p.add_argument("--target", choices=TARGETS, default="train",
                   help="what time-to-target waits for: exact's final training reward (smoothed curves) or its final "
                        "held-out test reward (the seed-mean evaluations, interpolated between evaluations) "
                        "[default: train]")
    p.add_argument("--train-only", metavar="NAME",
                   help="train only this variant's runs, no comparison: start one process per variant to run them "
                        "side by side (each under the same load), then the same command without it to compare")
    add_cost_arguments(p, "the projected time efficiency")
    p.add_argument("--out", help="bench output dir, one sub-dir per run [default: runs/bench_quality]")
    p.add_argument("--plot", help="PNG path [default: OUT/quality.png]; an existing file needs --overwrite")
    p.add_argument("--json", help="JSON path [default: OUT/quality.json]; an existing file needs --overwrite")
    p.add_argument("--quick", action="store_true",
                   help=f"a tiny smoke version, 2 seeds, into runs/bench_quality_quick: {' '.join(QUICK_SETS)}")
    p.set_defaults(func=_run)
