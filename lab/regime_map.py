"""Where JAGG is nearly exact: ``jagg bench meter`` over a grid of sampling regimes (lab/README.md).

A regime is a step count, an SDE type with its noise level, and a trained (SDE) window. In each, on the job's own
checkpoint and batch (the main job, or ``--config``, with ``--set`` on top), :func:`jagg.bench.meter_command.measure`
measures the estimators' error against the update's noise on-policy, with the meter's per-update rate range
(:func:`jagg.bench.meter_command.prediction`), and the regime's **linearity score**: routing's score
(:func:`jagg.routing.linearity_scores`, the paper's linearity test, what ``jagg_frac`` ranks by) of the shipped
layout's intervals, averaged over the samples of ``--batches`` rollouts, with its lowest sample-interval mean. The
score needs only a rollout, so a user can read it on their model without a backward pass.

Estimators (``--estimator``, as ``jagg bench meter``'s; default): plain JAGG, step groups of 4 (the main job's
``config``), shared knots W = 4, unbiased JAGG (p 0.25) and random timestep subsampling at plain JAGG's rows.

Regimes (default, 17): 10 steps (trained 0-7) and 20 steps (trained 0-15), each with DanceGRPO's SDE at eta 0.3, 0.7
and 1.0, Flow-GRPO's at 0.3 and 1.0 and CPS at 0.3 and 0.7; and the main job's SDE (dance, eta 1) at 10 steps with the
trained window cut to steps 0-3 (the noisy end), 4-7 (the clean end) and 2-7.
Records go to ``--json`` (JSON lines, appended per regime, so an interrupted map resumes) and a markdown table is
printed; ``--summary`` prints the table of a finished map without measuring. Every record keeps the settings it was
measured with (the regime's whole trainer config, the estimator's spec, ``--batches`` and ``--draws``): an estimator
already in the file for a regime is reused only when they are the ones asked for now, another one is measured (on
the same seeded batches), and records made under other settings (another ``--config``, ``--set``, spec of that name,
``--batches`` or ``--draws``) are refused, naming the setting, before anything is measured: one file, one map. A
``--set`` of a key the regimes set (``sample.num_steps``, ``sample.sde_type``, ``sample.eta``, ``sample.sde_window``)
is refused: it would make every row the same measurement under the regimes' labels.

    python -m lab regime-map --json runs/regime_map.json                      # the whole grid
    python -m lab regime-map --steps 20 --json runs/regime_map.json           # a part of it (resumes)
    python -m lab regime-map --json runs/regime_map.json --summary            # the table and the rule's fit
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from jagg.arguments import config_arguments
from jagg.bench.common import default_config_path, spearman
from jagg.infra.atomic import json_safe
from jagg.bench.meter_command import BUILT_IN, check_estimators, load_config, make_sampler, measure, spec_base
from jagg.trainers.side_by_side import kept_batch, layout_linearity
from jagg.checks import check_fields, check_unique_names, read_json_lines
from jagg.infra.config_loader import differences, to_dict
from lab.fixed_keys import OVERWRITES, refuse_fixed_keys

SDE_NOISE = {"dance": (0.3, 0.7, 1.0), "flow_grpo": (0.3, 1.0), "cps": (0.3, 0.7)}
WINDOWS = {10: [0, 8], 20: [0, 16]}                       # the trained (SDE) steps of each step count
CUT_WINDOWS = ([0, 4], [4, 8], [2, 8])                   # the main job's SDE at 10 steps, trained windows cut
ESTIMATORS = ["config", "s4:knots=shared,window=4", "unb:correction_p=0.25", "subsample"]


def regimes(steps: list[int], sdes: list[str], cuts: bool) -> list[dict]:
    """The grid: every step count x SDE x noise level at the full window, then (``cuts``) the main job's SDE at 10
    steps with its trained window cut."""
    grid = [{"num_steps": n, "sde_type": t, "eta": eta, "sde_window": WINDOWS[n]}
            for n in steps for t in sdes for eta in SDE_NOISE[t]]
    if cuts and 10 in steps:
        grid += [{"num_steps": 10, "sde_type": "dance", "eta": 1.0, "sde_window": list(w)} for w in CUT_WINDOWS]
    return grid


def key(r: dict) -> tuple:
    return r["num_steps"], r["sde_type"], r["eta"], tuple(r["sde_window"])


# the keys a regime sets (overrides), with the options that choose the regimes: never a --set's
REGIME_KEYS = dict.fromkeys(("sample.num_steps", "sample.sde_type", "sample.eta", "sample.sde_window"),
                            "its regimes (--steps, --sde, --no-cuts)")


def overrides(r: dict) -> list[str]:
    return [f"sample.num_steps={r['num_steps']}", f"sample.sde_type={r['sde_type']}", f"sample.eta={r['eta']}",
            f"sample.sde_window={r['sde_window']}"]


def linearity(cfg, batches: int) -> dict:
    """Routing's linearity score of the config's layout over ``batches`` fresh rollouts
    (:func:`jagg.bench.meter_command.layout_linearity`), for a map whose estimators leave out ``config``."""
    sampler = make_sampler(cfg)
    return layout_linearity([kept_batch(sampler, cfg)[0] for _ in range(batches)], spec_base(cfg))


def regime_config(r: dict, config: str | None, sets: list[str]):
    """The trainer config a regime is measured with: ``--config`` (the main job) with the regime's keys and ``--set``."""
    return load_config(config or default_config_path(), ["threads=1", *overrides(r), *sets])


def settings(cfg, spec: str, batches: int, draws: int) -> dict:
    """What a record was measured with, kept in it (``settings``): the regime's whole trainer config, the estimator's
    spec, the batches and draws."""
    return {"config": to_dict(cfg), "spec": spec, "batches": batches, "draws": draws}


def run_regime(r: dict, config: str | None, sets: list[str], specs: list[str], batches: int, draws: int) -> list[dict]:
    cfg = regime_config(r, config, sets)
    recs = measure(cfg, specs, batches, draws, None)
    scored = [rec for rec in recs if rec["estimator"] == "config"]      # the meter scored the config's layout on the
    lin = ({k: scored[0][k] for k in ("linearity", "linearity_min")} if scored    # very rollouts it measured
           else linearity(cfg, batches))
    spec_of = {s.partition(":")[0]: s for s in ["exact", *specs]}
    return [{**r, **{k: v for k, v in rec.items() if k != "tensors"}, **lin,               # the regime's score
             "settings": settings(cfg, spec_of[rec["estimator"]], batches, draws)} for rec in recs]


def to_measure(r: dict, cfg, specs: list[str], batches: int, draws: int, done: list[dict], path: Path) -> list[str]:
    """The ``specs`` regime ``r`` still needs (an estimator not in ``done`` for it); a stored record of the regime made
    under other settings than ``cfg``, ``batches`` and ``draws`` (or another spec under the same name) is a ValueError
    naming the setting: its rows would be printed as this map's answer."""
    now = settings(cfg, "", batches, draws)
    stored = {rec["estimator"]: rec for rec in done if key(rec) == key(r)}
    where = f"--json {path}: regime {key(r)}"
    for name, rec in stored.items():
        old = rec.get("settings")
        if not isinstance(old, dict) or not {"config", "spec", "batches", "draws"} <= old.keys():
            raise ValueError(f"{where}: the record of {name!r} does not say what it was measured with (written before "
                             "records kept their settings); use another --json, or --summary to print it")
        diff = differences(old["config"], now["config"]) if isinstance(old["config"], dict) else [("config", 0, 0)]
        for what, then, asked in ([(f"--set/--config {d[0]}", d[1], d[2]) for d in diff[:1]]
                                  + [(f"--{k}", old[k], now[k]) for k in ("batches", "draws") if old[k] != now[k]]):
            raise ValueError(f"{where}: {name!r} was measured with {what} {then!r}, not {asked!r}: the file holds "
                             "another map; use another --json, or the settings it was made with")
    todo = []
    for spec in specs:
        name = spec.partition(":")[0]
        if name not in stored:
            todo.append(spec)
        elif stored[name]["settings"]["spec"] != spec:
            raise ValueError(f"{where}: {name!r} was measured as {stored[name]['settings']['spec']!r}, not {spec!r}; "
                             "give the new definition another name, or use another --json")
    return todo


def num(v, spec: str) -> str:
    """``v`` formatted, or ``undefined`` where it could not be computed (None, NaN)."""
    return "undefined" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown(records: list[dict]) -> str:
    head = ("| steps | trained | SDE, eta | linearity (min) | estimator | rows/sample | E\\|e\\|^2/V_b (± SE) | bias z | "
            "rate/update |\n|---|---|---|---|---|---|---|---|---|")
    rows = [f"| {r['num_steps']} | {r['sde_window'][0]}-{r['sde_window'][1] - 1} | {r['sde_type']}, {r['eta']} | "
            f"{num(r['linearity'], '.3f')} ({num(r['linearity_min'], '.2f')}) | {r['estimator']} | "
            f"{num(r['rows_per_sample'], '.2f')} | {num(r['error_to_noise'], '.3f')} (± "
            f"{num(r['error_to_noise_se'], '.3f')}) | {num(r['bias_z'], '.1f')} | {r['prediction_range']} |"
            for r in records if r["estimator"] != "exact"]
    return "\n".join([head, *rows])


def summary(records: list[dict]) -> str:
    """How each estimator's error ranks with the regime's linearity score over the map (Spearman; negative: more
    linear, less error), over the regimes where both were computed."""
    lines = []
    for name in dict.fromkeys(r["estimator"] for r in records if r["estimator"] != "exact"):
        rs = [r for r in records if r["estimator"] == name
              and all(num(r[k], "") != "undefined" for k in ("linearity", "error_to_noise"))]
        if len(rs) >= 3:
            rho = spearman([r["linearity"] for r in rs], [r["error_to_noise"] for r in rs])
            lines.append(f"{name}: Spearman(linearity, E|e|^2/V_b) = {rho:+.2f} over {len(rs)} regimes")
    return "\n".join(lines)


# what every record of a map holds, by kind (jagg.checks.check_fields): what the tables read
RECORD_FIELDS = {"num_steps": "integer", "sde_type": "string", "eta": "number", "sde_window": "list",
                 "estimator": "string", "linearity": "number|null", "linearity_min": "number|null",
                 "rows_per_sample": "number|null", "error_to_noise": "number|null", "error_to_noise_se": "number|null",
                 "bias_z": "number|null", "prediction_range": "string"}


def load(path: Path) -> list[dict]:
    """The records of ``--json`` (none when it does not exist), each checked to be a JSON object holding
    :data:`RECORD_FIELDS`; a torn or foreign file is named with its line, never a decoder traceback."""
    if not path.exists():
        return []
    if not path.is_file():
        raise ValueError(f"--json {path} is not a file; give the map's JSON-lines file")
    fix = "repair or delete that line (a write cut short), or give another --json for a new map"
    records = read_json_lines(path, f"--json {path}", fix)
    for n, rec in enumerate(records, 1):
        check_fields(rec, RECORD_FIELDS, f"--json {path}: record {n}", fix=fix)
        if len(rec["sde_window"]) != 2:
            raise ValueError(f"--json {path}: record {n}: 'sde_window' must be [start, end]; {fix}")
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab regime-map", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    config_arguments(p, "the job whose regimes are mapped", main_job=False)
    p.add_argument("--steps", type=int, nargs="+", choices=sorted(WINDOWS), default=sorted(WINDOWS))
    p.add_argument("--sde", nargs="+", choices=sorted(SDE_NOISE), default=list(SDE_NOISE))
    p.add_argument("--no-cuts", action="store_true", help="leave out the regimes with a cut trained window")
    p.add_argument("--estimator", action="append", metavar="NAME[:KEY=VALUE,...]",
                   help=f"an estimator, as jagg bench meter's (repeatable) [default: {' '.join(ESTIMATORS)}]")
    p.add_argument("--batches", type=int, default=6, help="independent batches per regime (>= 3) [default: 6]")
    p.add_argument("--draws", type=int, default=3, help="draws of a random estimator per batch [default: 3]")
    p.add_argument("--json", required=True, help="records (JSON lines; regimes already there are skipped)")
    p.add_argument("--summary", action="store_true", help="only print the table of the records in --json")
    args = p.parse_args(argv)
    path = Path(args.json)
    done = load(path)
    if args.summary:
        if not done:
            raise ValueError(f"--summary: no records in {path}")
        print(markdown(done) + "\n\n" + summary(done))
        return 0
    if args.batches < 3 or args.draws < 1:
        raise ValueError(f"--batches must be >= 3 and --draws >= 1; got {args.batches} and {args.draws}")
    refuse_fixed_keys(args.set, REGIME_KEYS, "python -m lab regime-map", OVERWRITES)
    specs = args.estimator or ESTIMATORS
    check_unique_names(specs, BUILT_IN, "--estimator")
    plan = []                                      # (regime, its config, the specs still to measure): all checked first
    for r in regimes(args.steps, args.sde, not args.no_cuts):
        cfg = regime_config(r, args.config, args.set)
        check_estimators(specs, cfg)               # e.g. a window longer than a cut window's trained steps
        plan.append((r, to_measure(r, cfg, specs, args.batches, args.draws, done, path)))
    for r, todo in plan:
        if not todo:
            continue
        recs = run_regime(r, args.config, args.set, todo, args.batches, args.draws)
        if any(rec["estimator"] == "exact" and key(rec) == key(r) for rec in done):
            recs = [rec for rec in recs if rec["estimator"] != "exact"]        # measured alike: stored once
        with path.open("a") as f:
            for rec in recs:
                f.write(json.dumps(json_safe(rec)) + "\n")
        done += recs
        print(markdown(recs), flush=True)
    print("\n" + markdown(done) + "\n\n" + summary(done))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
