"""``python -m lab quality``: does a JAGG variant reach a given reward sooner than exact? Paired GRPO runs x seeds.

Every variant trains with :class:`jagg.trainers.shapes_trainer.ShapesTrainer` from the same config (the main job plus ``--set``),
for the same iterations and optimizer updates, once per seed; a config with a ``pipeline:`` section trains the user's
diffusers model with :class:`jagg.trainers.diffusers_trainer.DiffusersTrainer` instead (as ``jagg train`` would). That trainer
has no held-out evaluation: the comparison is on the training reward (``--target train``); ``--target test``,
``--eval-every`` and ``--eval-dense`` are refused, and the held-out figures below are empty (NaN). Seeds are paired across variants: a seed fixes the
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
  of ``python -m lab e2e`` it estimates the time ratio without the load of the machine in it). A variant that never gets there counts as reaching
  it at its last iteration (an upper bound of its ratio); the share of such resamples is reported.
- ``--target test``: the same with exact's final *held-out* test reward as the target (mean over seeds of the last
  evaluation), reached where the seed-mean test curve first crosses it (linear between evaluations). Always reported
  too: the updates-to-target ratio with its interval, and ``time_ratio_estimate`` = updates-to-target ratio times the
  CPU-seconds iteration ratio of the same runs (the load of the machine taken out), and the held-out gain of each
  variant over its start (``test_gain``, with its interval). Also ``efficiency_to_lower_final`` = the updates exact needs to reach the highest held-out reward both reach (the lower of
  the two seed-mean final rewards) over the updates the variant needs, with its interval, and
  ``time_efficiency_to_lower_final`` = that times the CPU-seconds iteration ratio. A variant that levels off lower
  reaches that level at its own end, so this figure mixes the rate with the plateau: read the two below apart.
- **rate and plateau** (held-out reward; intervals as above, every resample of seeds paired across variants):
  - ``rate_25``, ``rate_50``, ``rate_75``: the rate (learning per update against exact's), the updates exact needs to gain 25%, 50%,
    75% of the *smaller* of the two held-out gains (a gain: the plateau minus the first evaluation) over the updates
    the variant needs (each curve's seed mean, read between evaluations); ``rate``: their geometric mean (compare the
    meter's per-update prediction). Where the smaller gain is not > 0 (a variant that never rises) they are
    undefined: NaN, printed "unreached (no gain)", ``rate_status`` says why.
  - ``plateau_gap``: the variant's plateau minus exact's, a plateau being the mean of the last ``--plateau-evals``
    evaluations (``plateau_evals``; from iteration ``plateau_from_iteration`` on). ``late_rise``: the curve's
    plateau minus the mean of as many evaluations before it; ``plateau_status`` ``rising`` where its interval lies
    above 0 (not levelled off: while exact still rises, the gap is read before the plateau and is partly a rate),
    ``levelled`` otherwise. ``lag_gap``: the part of the gap the rate alone explains (exact's curve read at the rate
    times its updates); ``plateau_excess``: the rest, a plateau of the variant's own.
  - at an equal budget: ``budget`` = the smaller of the two runs' CPU seconds (seed means), ``budget_exact`` and
    ``budget_reward`` the two held-out rewards when it runs out (interpolated between evaluations), ``budget_diff``
    their difference: what a user has when the budget ends. ``projected_budget_diff`` is the same in
    the projected time of ``--cost``'s structure (``projected_budget`` in exact's iterations).
  - ``--eval-dense N:EVERY`` adds evaluations every EVERY iterations up to iteration N (``eval.dense_iterations``,
    ``eval.dense_every``), where the curve rises, so that each level is read from more points; each costs one
    evaluation (``eval_s`` per run is reported). The evaluation settings are part of a run's identity: a finished run
    evaluated on another schedule is not reused.
- **final test reward** at equal updates (held-out test prompts, the trainer's last evaluation), its mean, interval,
  the paired difference to exact with its interval, and the evaluation's own noise (per-image standard error).
- the machine's load while each run trained (its mean 1-minute load average), and a line when the variants saw
  unlike loads or a run more than the machine's cores: their CPU clocks carry it.
- the training reward at the start and the end (means over the first and last 10% of iterations): a variant that
  ends below its start has drifted.
- held-out evaluations per run and their seconds (``evaluations``, ``eval_s``: the cost of a denser schedule).
- backward rows per update, the iteration-time ratio exact / variant, and its ideal: sampling and reward as exact's,
  training scaled by the cost model (``B = 2F``) applied to the measured rows (``3 rows_exact / (3 rows + nograd)``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jagg.arguments import config_arguments
from jagg.checks import SEED_MAX, check_output_file, number_arg
from jagg.bench.common import table
from jagg.infra.atomic import write_json
from jagg.trainers.diffusers_config import has_pipeline_section
from jagg.cost import CostStructure, add_cost_arguments, config_structure, default_cost, resolve
from lab.fixed_keys import OVERWRITTEN, refuse_fixed_keys
from lab.quality_compare import CLOCKS, TARGETS, compare
from lab.quality_report import RUN_COLUMNS, plot, print_report, run_rows
from lab.quality_runs import QUICK_SETS, QualityConfig, parse_variants, quick_sets, run_one
from lab.statistics import PLATEAU_EVALS


def run_quality(q: QualityConfig, clock: str = "wall", train_only: str | None = None,
                target: str = "train", cost: CostStructure | None = None,
                plateau_evals: int = PLATEAU_EVALS) -> list[dict]:
    """Train (or skip, or resume) every run and compare (``cost``, ``plateau_evals``: as
    :func:`lab.quality_compare.compare`). ``train_only``: train just that variant's runs and return them
    without a comparison (to run two variants side by side in two processes, which then share whatever else loads the
    machine; a last call without it compares)."""
    names = list(q.variants)
    for v in names:                                     # every variant's config loads before any run trains
        cfg = q.train_config(v, q.seeds[0])
        if target == "test" and getattr(cfg, "eval", None) is None:
            raise ValueError("--target test compares held-out rewards, but a config with a pipeline: section trains "
                             "with the diffusers trainer, which has no held-out evaluation; use --target train")
        if target == "test" and cfg.eval.every == 0:    # refused before any run trains, not after all of them
            raise ValueError(f"--target test compares held-out rewards, but variant {v!r} evaluates only at its start "
                             "and end (--eval-every 0, eval.every=0); give --eval-every N > 0")
    if train_only is not None:
        if train_only not in names:
            raise ValueError(f"--train-only {train_only!r} is not one of the variants {names}")
        return [run_one(q, train_only, s) for s in q.seeds]
    runs = [run_one(q, v, s) for s in q.seeds for v in names]        # seed-major, alternating variants
    return runs + compare(runs, names, q.seeds, clock, target, cost, plateau_evals)


def parse_eval_dense(spec: str) -> list[str]:
    """``--eval-dense N:EVERY`` -> the ``--set`` strings of ``eval.dense_iterations`` and ``eval.dense_every``."""
    n, colon, every = spec.partition(":")
    try:
        values = int(n), int(every)
    except ValueError:
        values = None
    if not colon or values is None or min(values) < 1:
        raise ValueError(f"--eval-dense {spec!r}: give N:EVERY, two integers >= 1 (evaluate every EVERY iterations "
                         "up to iteration N), e.g. 40:2")
    return [f"eval.dense_iterations={values[0]}", f"eval.dense_every={values[1]}"]


def _config(args: argparse.Namespace) -> QualityConfig:
    """The bench's :class:`QualityConfig` from the command line (``--quick``'s settings first, the user's win); a
    diffusers config's refuses the options of a held-out evaluation it does not have, naming them."""
    diffusers = has_pipeline_section(args.config)
    for flag, value in (("--eval-every", args.eval_every), ("--eval-dense", args.eval_dense)):
        if diffusers and value is not None:
            raise ValueError(f"{flag}: a config with a pipeline: section trains with the diffusers trainer, which has "
                             "no held-out evaluation; leave it out")
    refuse_fixed_keys(args.set, {"seed": "--first-seed and --seeds", "log.output_dir": "--out (its variant/seedN/)"},
                      "python -m lab quality", OVERWRITTEN)
    sets = (quick_sets(diffusers) if args.quick else []) + list(args.set or [])
    if args.iterations is not None:
        sets.append(f"grpo.iterations={args.iterations}")
    if args.eval_every is not None:
        sets.append(f"eval.every={args.eval_every}")
    if args.eval_dense is not None:
        sets += parse_eval_dense(args.eval_dense)
    n_seeds = args.seeds if args.seeds is not None else (2 if args.quick else 5)
    variants = parse_variants(args.variant or ["exact", "config"])
    out = args.out if args.out is not None else ("runs/bench_quality_quick" if args.quick else "runs/bench_quality")
    return QualityConfig(config=args.config, sets=sets, variants=variants,
                         seeds=list(range(args.first_seed, args.first_seed + n_seeds)), out=out)


def _eval_cost(runs: list[dict]) -> str:
    """One line: the held-out evaluations per run and what they cost beside the training (medians over runs)."""
    import statistics

    # a result written before "evaluations" was recorded counts its held-out curve's points
    evals = statistics.median(r.get("evaluations", len(r.get("test_curve") or [])) for r in runs)

    secs = [r["eval_s"] for r in runs if r.get("eval_s") is not None]
    if not secs:
        return f"held-out evaluations: {evals:g} per run"
    eval_s, wall = statistics.median(secs), statistics.median(r["wall_s"] for r in runs)
    return (f"held-out evaluations: {evals:g} per run, {eval_s:.1f} s per run (median), "
            f"{100 * eval_s / wall if wall else float('nan'):.0f}% of the training iterations' wall-clock")


def _run(args: argparse.Namespace) -> int:
    q = _config(args)
    cfg = q.train_config("exact", q.seeds[0])
    p = getattr(cfg, "pipeline", None)                  # a diffusers config's model
    cost, cost_line = resolve(args.cost, config_structure(cfg), args.gpu_bench_json, default_cost(cfg))
    png = Path(q.out) / "quality.png" if args.plot is None else args.plot
    json_path = Path(q.out) / "quality.json" if args.json is None else args.json
    if args.train_only is None:                         # the comparison's files, checked before any run trains
        check_output_file(png, "--plot", args.overwrite, (".png",))
        check_output_file(json_path, "--json", args.overwrite)
    records = run_quality(q, args.clock, args.train_only, args.target, cost, args.plateau_evals)
    runs = [r for r in records if r["kind"] == "run"]
    if args.train_only is not None:
        print(table(run_rows(runs), RUN_COLUMNS))
        print("trained; run the same command without --train-only to compare the variants")
        return 0
    summary = [r for r in records if r["kind"] == "variant"]
    print_report(runs, summary, q.seeds, cost_line)
    print(_eval_cost(runs) if p is None else "held-out evaluations: none (the diffusers trainer does not evaluate on "
          "held-out prompts): read time-to-target and the iteration ratios, on the training reward")
    for r in summary:
        r["cost_structure"] = cost_line
    plot(runs, Path(png), **({} if p is None else {"title": f"GRPO on {p.family}"}), clock=args.clock)
    print(f"\nwrote {png}")
    write_json(json_path, records)
    print(f"wrote {json_path}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("quality", help="paired GRPO runs exact vs JAGG variants x seeds: time to reward, final reward",
                       description=__doc__.replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter)
    config_arguments(p, "shared by every run; one with a pipeline: section trains that diffusers model with the "
                        "diffusers trainer", "grpo.iterations=200")
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
    p.add_argument("--eval-dense", metavar="N:EVERY",
                   help="also evaluate every EVERY iterations up to iteration N, where the curve rises (eval."
                        "dense_iterations, eval.dense_every): more points for the rate's levels, one evaluation's "
                        "cost each (eval_s is reported) [default: the config's, none]")
    p.add_argument("--plateau-evals", type=number_arg(int, 1), default=PLATEAU_EVALS,
                   help=f"the last evaluations a plateau averages (the plateau gap, the gains of the rate) "
                        f"[default: {PLATEAU_EVALS}]")
    p.add_argument("--clock", choices=CLOCKS, default="wall",
                   help="time axis of time-to-target: wall-clock seconds, CPU seconds of the training process (with "
                        "threads=1 the two agree on an idle machine; CPU seconds ignore waiting for a busy core, not "
                        "a slower one), or iterations (updates to target: multiply by the iteration-time ratio of "
                        "`python -m lab e2e` for a load-independent time estimate) [default: wall]")
    p.add_argument("--target", choices=TARGETS, default="train",
                   help="what time-to-target waits for: exact's final training reward (smoothed curves) or its final "
                        "held-out test reward (the seed-mean evaluations, interpolated between evaluations; not for "
                        "a diffusers config, whose trainer does not evaluate) [default: train]")
    p.add_argument("--train-only", metavar="NAME",
                   help="train only this variant's runs, no comparison: start one process per variant to run them "
                        "side by side (each under the same load), then the same command without it to compare")
    add_cost_arguments(p, "the projected columns (the rate and the efficiency to the lower final reward per "
                          "projected time, the reward at an equal projected budget)")
    p.add_argument("--out", help="bench output dir, one sub-dir per run [default: runs/bench_quality]")
    p.add_argument("--plot", help="PNG path [default: OUT/quality.png]; an existing file needs --overwrite")
    p.add_argument("--json", help="JSON path [default: OUT/quality.json]; an existing file needs --overwrite")
    p.add_argument("--quick", action="store_true",
                   help=f"a tiny smoke version, 2 seeds, into runs/bench_quality_quick: {' '.join(QUICK_SETS)} "
                        "(a diffusers config: without the eval. keys)")
    p.set_defaults(func=_run)
