"""The runs of ``python -m lab quality``: what each variant trains (:class:`QualityConfig`), one run trained, resumed
or reused (:func:`run_one`), and its result (:func:`summarize`, ``OUT/<variant>/seed<k>/result.json``). A run
trains with the trainer of its config, as ``jagg train`` picks it: the shapes world's (:class:`QualityRun`), or for a
config with a ``pipeline:`` section the diffusers trainer (:class:`DiffusersQualityRun`, no held-out evaluation).

A finished run is reused only when the config it was trained with is the one asked for, evaluation settings
included (:data:`RECORDS_SAME`): a setting that changes what a run records is part of its identity, so a run
evaluated on another schedule is never reused as if it had this one. An unfinished run resumes under the same rule.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from jagg.checks import check_fields, check_seed, check_unique_names, has_kind, parse_spec, read_json, shown
from jagg.trainers.resume import RESUMABLE_CHANGES, check_resumable
from jagg.trainers.diffusers_config import DiffusersTrainConfig
from jagg.trainers.shapes_trainer import ShapesTrainer
from jagg.infra.config_loader import to_dict
from jagg.infra.rundir import RunHints
from jagg.infra.atomic import write_json
from jagg.bench.meter_command import TrainConfig, load_config
from lab.machine_load import MachineLoad

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


def quick_sets(diffusers: bool) -> list[str]:
    """``--quick``'s keys: :data:`QUICK_SETS`, for a diffusers config (no ``eval:`` section) without the ``eval.``
    ones."""
    return [k for k in QUICK_SETS if not (diffusers and k.startswith("eval."))]


# config keys that may differ between a run on disk and the run asked for: the trainer's resumable changes less
# the evaluation's schedule and sizes, which change what a run records (the warnings and the grids do not), and the
# threads, which change its seconds
RECORDS_SAME = tuple(k for k in RESUMABLE_CHANGES if k not in ("eval.", "threads")) + (
    "eval.warn_drop", "eval.warn_empty", "eval.warn_background", "eval.grid_size")
# what a run's result keeps of its last audit record (estimator.meter_every > 0): the meter's final prediction
METER = ("audits", "error_to_noise", "bias_to_noise", "bias_to_noise_se", "bias_z", "rows_ratio",
         "predicted_efficiency", "predicted_time_efficiency", "predicted_adam_efficiency",
         "predicted_adam_time_efficiency", "predicted_adam_tensor_efficiency", "predicted_adam_tensor_time_efficiency")
# what it keeps of estimator.mode auto's decision (its measurement's cost is in the iterations' clocks)
PREFLIGHT = ("train_with", "reason", "preflight_cpu_s", "measured_iterations", "measured_updates", "minibatches",
             "best_candidate", "best_time_rate_lo", "best_time_rate_hi")
# ... and of every audit record, along the run (does the error or the bias grow as the policy sharpens?)
METER_CURVE = ("iteration", "error_to_noise", "bias_to_noise", "bias_z")
# what a run's result.json holds, by kind (jagg.checks.check_fields): what the comparison reads in every one, the rest
# where it was written (a result of an older bench may lack them)
RESULT_FIELDS = {"iterations": "integer", "config": "object", "train_curve": "list", "test_curve": "list",
                 "final_test_reward": "number|null", "final_test_reward_std": "number|null",
                 "rows_per_update": "number", "nograd_per_update": "number", "iter_s": "number|null",
                 "train_s": "number|null", "wall_s": "number", "kind": "string", "variant": "string",
                 "seed": "integer", "estimator": "object", "updates": "integer", "eval_images": "integer|null",
                 "final_held_out_reward": "number|null", "evaluations": "integer", "eval_s": "number",
                 "sample_s": "number|null", "reward_s": "number|null", "iter_cpu_s": "number|null",
                 "meter": "object|null", "meter_curve": "list", "load": "object"}
RESULT_REQUIRED = ("iterations", "config", "train_curve", "test_curve", "final_test_reward",
                   "final_test_reward_std", "rows_per_update", "nograd_per_update", "iter_s", "train_s", "wall_s")
CURVE_WIDTHS = {"train_curve": 4, "test_curve": 3}      # TRAIN_CURVE, TEST_CURVE of lab.quality_compare


def read_result(path: Path) -> dict:
    """A run's ``result.json``, checked to hold what :func:`summarize` writes (:data:`RESULT_FIELDS`; the curves
    rows of numbers); a torn or changed file is a ValueError naming it, the key and what was expected, and what to do
    (delete it: the run's checkpoints stay, and the run is summarized again)."""
    fix = "delete it (the run's checkpoints stay, and the run is summarized again)"
    where = f"the run result {path}"
    result = read_json(path, "a run result", "object", fix)
    check_fields(result, RESULT_FIELDS, where, tuple(k for k in RESULT_FIELDS if k not in RESULT_REQUIRED), fix)
    for key, width in CURVE_WIDTHS.items():
        bad = next((row for row in result[key] if not isinstance(row, list) or len(row) != width
                    or not all(has_kind(v, "number|null") for v in row)), None)
        if bad is not None:
            raise ValueError(f"{where}: {key!r} must be a list of rows of {width} numbers; it holds {shown(bad)}; "
                             f"{fix}")
    return result


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

    def train_config(self, variant: str, seed: int) -> TrainConfig:
        """The config of one run: a diffusers one for a YAML with a ``pipeline:`` section, else the shapes world's
        (:func:`jagg.bench.meter_command.load_config`)."""
        run = [f"seed={seed}", f"log.output_dir={self.run_dir(variant, seed)}"]
        try:
            return load_config(self.config, DEFAULT_SETS + self.sets + self.variants[variant] + run)
        except ValueError as e:
            raise ValueError(f"variant {variant!r}: {e}") from None

    def run_dir(self, variant: str, seed: int) -> Path:
        return Path(self.out) / variant / f"seed{seed}"


def summarize(records: list[dict], cfg: TrainConfig, variant: str, seed: int) -> dict:
    """One run's result from its metrics records (a diffusers run's: no held-out evaluation, no test curve)."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    audits = [r for r in records if r.get("kind") == "audit"]
    per_iter = cfg.grpo.inner_epochs * cfg.grpo.updates_per_epoch
    med = lambda k: statistics.median(r[k] for r in train) if train else float("nan")
    updates = len(train) * per_iter
    ev = getattr(cfg, "eval", None)
    n_eval = ev.num_prompts or None if ev is not None else None
    last = evals[-1] if evals else {}
    return {
        "kind": "run", "variant": variant, "seed": seed, "estimator": cfg.estimator.to_dict(),
        "iterations": cfg.grpo.iterations, "updates": updates,
        "final_test_reward": last.get("reward_mean"), "final_test_reward_std": last.get("reward_std"),
        "eval_images": (n_eval or _num_test_prompts()) * ev.images_per_prompt if ev is not None else None,
        "final_held_out_reward": last.get("held_out_reward"),
        "evaluations": len(evals), "eval_s": sum(r.get("eval_s", 0.0) for r in evals),
        "sample_s": med("sample_s"), "reward_s": med("reward_s"), "train_s": med("train_s"), "iter_s": med("iter_s"),
        "iter_cpu_s": med("iter_cpu_s"),
        "wall_s": train[-1]["wall_s"] if train else 0.0,
        "rows_per_update": sum(r.get("backward_items", 0) for r in train) / max(updates, 1),
        "nograd_per_update": sum(r.get("forward_nograd_items", 0) for r in train) / max(updates, 1),
        "meter": {k: audits[-1].get(k) for k in METER} if audits else None,
        "preflight": ({k: pre[0].get(k) for k in PREFLIGHT} if (pre := [r for r in records if r.get("kind") ==
                                                                       "preflight"]) else None),   # estimator.mode auto
        "meter_curve": [[r.get(k) for k in METER_CURVE] for r in audits],                                  # along the run
        "train_curve": [[r["iteration"], r["wall_s"], r["reward_mean"], r.get("cpu_s")] for r in train],   # TRAIN_CURVE
        "test_curve": [[r["iteration"], r["wall_s"], r["reward_mean"]] for r in evals],                    # TEST_CURVE
    }


def _num_test_prompts() -> int:
    from jagg.shapes import test_prompts

    return len(test_prompts())


# what the runs' refusals and notes tell the user to do: the bench has no --resume and keeps its runs in --out
HINTS = RunHints(continue_run="rerun the same python -m lab quality command to continue", other_dir="use another --out",
                 start_over="move that run directory away and rerun")


class BenchRun:
    """One run of the bench, mixed into a trainer: the trainer in the bench's words (:data:`HINTS`), whose stop on
    SIGINT/SIGTERM (the iteration finished and saved) is the bench's interruption: a ``KeyboardInterrupt``, so that
    no result is written as if the run were complete, even when the signal came in its last iteration."""

    hints = HINTS

    def load_state(self, state: dict) -> list[str]:
        """The trainer's restore, after the bench's own check: the evaluation settings must be the run's
        (:data:`RECORDS_SAME`), so that one run's test curve has one schedule."""
        try:
            check_resumable(state["config"], to_dict(self.cfg), RECORDS_SAME)
        except ValueError as e:
            raise ValueError(f"{e} (the bench keeps a run's evaluation settings)") from None
        return super().load_state(state)

    def train(self) -> list[dict]:
        records = super().train()
        if self.stopped:
            raise KeyboardInterrupt(f"{self.out} saved at iteration {self.iteration}; {HINTS.continue_run}")
        return records


class QualityRun(BenchRun, ShapesTrainer):
    """A run of a shapes-world config (:class:`BenchRun` of :class:`jagg.trainers.shapes_trainer.ShapesTrainer`)."""


def trainer_of(cfg: TrainConfig) -> type:
    """The bench's trainer of ``cfg``: :class:`QualityRun`, or for a diffusers config :class:`BenchRun` of
    :class:`jagg.trainers.diffusers_trainer.DiffusersTrainer` (imported only then: it needs diffusers)."""
    if not isinstance(cfg, DiffusersTrainConfig):
        return QualityRun
    from jagg.trainers.diffusers_trainer import DiffusersTrainer

    return type("DiffusersQualityRun", (BenchRun, DiffusersTrainer), {"__doc__": "A run of a diffusers config."})


def run_one(q: QualityConfig, variant: str, seed: int) -> dict:
    """Train (or resume, or skip) one run and return its summary: a finished run (its ``result.json``) of the same
    iterations and config is reused, evaluation settings and threads included (:data:`RECORDS_SAME`)."""
    cfg = q.train_config(variant, seed)
    out = q.run_dir(variant, seed)
    done = out / "result.json"
    if done.is_file():
        result = read_result(done)
        if result["iterations"] == cfg.grpo.iterations:
            try:
                check_resumable(result["config"], to_dict(cfg), RECORDS_SAME)
            except (KeyError, ValueError) as e:
                raise ValueError(f"{done} was trained with another config ({e}); use another --out") from None
            print(f"quality: {variant} seed {seed}: already done ({done}), skipped", flush=True)
            return {**result, "variant": variant}          # its directory is this variant's (even if renamed)
    print(f"quality: {variant} seed {seed}: training {cfg.grpo.iterations} iterations into {out}", flush=True)
    try:
        with MachineLoad() as load:           # beside the clocks: what else the machine ran meanwhile
            records = trainer_of(cfg).run(cfg, resume=True)
    except ValueError as e:                   # any refusal of the run (its directory, its config): named by it
        raise ValueError(f"run {out}: {e}") from None
    result = {**summarize(records, cfg, variant, seed), "load": load.summary(), "config": to_dict(cfg)}
    write_json(done, result)
    return result


