"""``estimator.mode: auto`` against exact with the machine's load taken out: each auto run read off its twin.

A pre-flight restores every RNG and weight it touched, so an auto run that chose estimator X trains as the fixed run
of X with the same seed does, bit for bit (``tests/test_auto.py``); it differs by the pre-flight's seconds only. On a
shared machine its CPU seconds per iteration still differ from the twin's, by what ran beside each. This tool reads
the runs of one ``python -m lab quality`` output directory and, per seed, takes the twin's run (the variant
``--twin NAME=VARIANT`` names for the decision NAME; exact for exact) shifted by the auto run's pre-flight seconds as
the auto run: its held-out curve must equal auto's own (checked, 1e-9), else, or where no twin was trained, auto's own
run stands. Then the paired comparison of :func:`lab.quality_compare.compare` (the CPU clock, the held-out target),
for the twins and for auto's own runs: auto - exact at an equal CPU budget with its 95% interval over seeds.

Usage (after ``python -m lab quality ... --variant exact --variant s5p1:... --variant auto:mode=auto``)::

    python -m lab auto-twins --out runs/q_auto_j20 --twin s5u=s5p1
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import numpy as np

from jagg.arguments import overwrite_argument
from jagg.bench.common import fmt
from jagg.infra.atomic import write_json
from lab.plateau_mechanism import checked_seeds, load_runs
from lab.quality_compare import TRAIN_CURVE, compare

SAME = 1e-9          # how far two held-out curves may differ and still be one training


def parse_twin(spec: str) -> tuple[str, str]:
    """``NAME=VARIANT``: the auto decision NAME (a candidate's name) and the quality variant trained with it."""
    name, sep, variant = spec.partition("=")
    if not sep or not name.strip() or not variant.strip():
        raise ValueError(f"--twin {spec!r} must be NAME=VARIANT: a candidate's name as auto's decision gives it and "
                         "the variant directory of the fixed runs of that estimator, e.g. s5u=s5p1")
    return name.strip(), variant.strip()


def decision(run: dict, where: str) -> dict:
    """The pre-flight's record of an auto run (``train_with``, ``preflight_s``, ``preflight_cpu_s``)."""
    pre = run.get("preflight")
    if not isinstance(pre, dict) or not {"train_with", "preflight_s", "preflight_cpu_s"} <= set(pre):
        raise ValueError(f"{where} holds no pre-flight decision (train_with, preflight_s, preflight_cpu_s): is it a "
                         "run of estimator.mode auto? name auto's variant with --auto")
    return pre


def shifted(twin: dict, pre: dict) -> dict:
    """``twin`` as the auto run it equals: every clock of its train curve moved by the pre-flight's seconds, which
    :func:`lab.quality_compare.curves` also reads as the clock at the evaluation before training."""
    run = copy.deepcopy(twin)
    wall, cpu = TRAIN_CURVE.index("wall"), TRAIN_CURVE.index("cpu")
    for row in run["train_curve"]:
        row[wall] += pre["preflight_s"]
        row[cpu] += pre["preflight_cpu_s"]
    run["preflight"] = pre
    return run


def same_training(a: dict, b: dict) -> bool:
    """Whether two runs' held-out curves are one training's (every evaluation within :data:`SAME`)."""
    x = np.array([p[2] for p in a["test_curve"]], dtype=float)
    y = np.array([p[2] for p in b["test_curve"]], dtype=float)
    return x.shape == y.shape and bool(np.all(np.abs(x - y) <= SAME))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab auto-twins", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the python -m lab quality output directory (--out) of the runs")
    p.add_argument("--seeds", type=int, default=5, help="seeds 0 .. N-1 [default: 5]")
    p.add_argument("--auto", default="auto", help="the variant of the estimator.mode auto runs [default: auto]")
    p.add_argument("--twin", action="append", default=[], metavar="NAME=VARIANT",
                   help="the fixed runs of auto's decision NAME (repeatable); exact's are the variant exact")
    p.add_argument("--json", help="also write the records to this JSON file")
    overwrite_argument(p, "--json")
    args = p.parse_args(argv)
    seeds, out = checked_seeds(args), Path(args.out)
    twins = {"exact": "exact", **dict(parse_twin(s) for s in args.twin)}
    runs = load_runs(out, {"exact", args.auto}, seeds)
    records, read = [], []
    for s in seeds:
        own = runs[(args.auto, s)]
        pre = decision(own, own["path"])
        twin, how = twins.get(pre["train_with"]), "own run (no --twin for its decision)"
        if twin is not None:
            if (twin, s) not in runs and not (out / twin / f"seed{s}" / "result.json").is_file():
                twin, how = None, f"own run ({twin} seed {s} not trained)"
            else:
                fixed = runs.get((twin, s)) or load_runs(out, {twin}, [s])[(twin, s)]     # exact's: read above
                if same_training(own, fixed):
                    how = f"{twin}'s run, shifted by the pre-flight"
                else:
                    twin, how = None, f"own run ({twin}'s held-out curve differs: not the same training)"
        run = own if twin is None else shifted(fixed, pre)
        read.append({**run, "variant": "twin", "seed": s})
        records.append({"kind": "seed", "seed": s, "train_with": pre["train_with"],
                        "preflight_cpu_s": pre["preflight_cpu_s"], "read_as": how})
    exact_runs = [{**runs[("exact", s)], "seed": s} for s in seeds]
    own_runs = [{**runs[(args.auto, s)], "variant": "own", "seed": s} for s in seeds]
    for name, rs in (("twin", read), ("own", own_runs)):
        rec = compare(exact_runs + rs, ["exact", name], seeds, clock="cpu", target="test")[1]
        records.append({"kind": "comparison", "auto_read_as": name, "budget_s": rec["budget"],
                        **{k: rec[k] for k in ("budget_diff", "budget_diff_lo", "budget_diff_hi")}})
    for r in records[:-2]:
        print(f"seed {r['seed']}: auto chose {r['train_with']} (pre-flight {r['preflight_cpu_s']:.1f} CPU s); read as "
              f"{r['read_as']}")
    for r in records[-2:]:
        what = "its twins' runs (the load taken out)" if r["auto_read_as"] == "twin" else "its own runs (as measured)"
        print(f"auto - exact at an equal CPU budget ({fmt(r['budget_s'], '.0f')} s), auto read off {what}: "
              f"{r['budget_diff']:+.3f} [{r['budget_diff_lo']:+.3f}, {r['budget_diff_hi']:+.3f}]")
    if args.json is not None:
        write_json(args.json, records)
    return 0
