"""Where JAGG pays: ``jagg bench efficiency`` over a grid of sampling regimes (docs/RESULTS.md, the regime map).

Regimes: 10 steps (SDE and trained steps 0-7) and 20 steps (0-11), each SDE type at two noise levels. Estimators
in each: plain JAGG (``correction_p`` 0) and unbiased JAGG (``correction_p`` 0.25) with groups of W = 3, 4 and 8, and
random timestep subsampling at the rows of unbiased W = 4. Every regime is one call of
:func:`jagg.bench.efficiency.measure` on the main job's checkpoint and batch (8 prompts x 4), with ``--set`` on top.
Records go to ``--json`` (appended per regime, so an interrupted map resumes) and a markdown table is printed.

    python benchmarks/regime_map.py --json runs/regime_map.json                  # the whole grid (see below)
    python benchmarks/regime_map.py --steps 20 --sde flow_grpo --json runs/rm.json    # a part of it

The whole grid took ~40 min on one core (an estimator of ``correction_p: auto``, since retired, made one 10-step
regime take 16 CPU minutes on a loaded machine, 2026-12-02).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from jagg.bench.efficiency import measure
from jagg.trainers.shapes_config import ShapesTrainConfig
from jagg.training import config_loader as configuration

WINDOWS = {10: [0, 8], 20: [0, 12]}
NOISE = {"flow_grpo": (0.3, 1.0), "dance": (0.3, 0.7), "cps": (0.3, 0.7)}
ESTIMATORS = [f"{kind}{w}:window={w},correction_p={p}" for w in (3, 4, 8) for kind, p in (("plain", 0), ("unb", 0.25))]


def regimes(steps: list[int], sdes: list[str]) -> list[dict]:
    return [{"num_steps": n, "sde_type": t, "eta": eta} for n in steps for t in sdes for eta in NOISE[t]]


def run_regime(r: dict, sets: list[str], batches: int, draws: int) -> list[dict]:
    overrides = ["threads=1", f"sample.num_steps={r['num_steps']}",
                 f"sample.sde_window={WINDOWS[r['num_steps']]}", f"sample.sde_type={r['sde_type']}",
                 f"sample.eta={r['eta']}", "estimator.window=4", "estimator.correction_p=0.25", *sets]
    cfg = configuration.load(ShapesTrainConfig, None, overrides)
    recs = measure(cfg, [*ESTIMATORS, "subsample"], batches, draws, None)
    return [{**r, **rec} for rec in recs]


def markdown(records: list[dict]) -> str:
    head = ("| steps | SDE | eta | estimator | rows/sample | E\\|e\\|^2/V_b | bias^2/V_b (SE) | efficiency | "
            "time eff. | bias^2/V_b at 1,024 |\n|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for r in records:
        if r["estimator"] == "exact":
            continue
        at = r["bias_to_noise"] * 1024 / r["samples_per_batch"]
        rows.append(f"| {r['num_steps']} | {r['sde_type']} | {r['eta']} | {r['estimator']} | {r['rows_per_sample']:.2f} "
                    f"| {r['error_to_noise']:.3f} | {r['bias_to_noise']:.4f} ({r['bias_to_noise_se']:.4f}) | "
                    f"{r['efficiency']:.2f} | {r['time_efficiency']:.2f} | {at:.3f} |")
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, nargs="+", choices=sorted(WINDOWS), default=sorted(WINDOWS))
    p.add_argument("--sde", nargs="+", choices=sorted(NOISE), default=list(NOISE))
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--draws", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="trainer config override")
    p.add_argument("--json", required=True, help="records (JSON lines; regimes already there are skipped)")
    args = p.parse_args(argv)
    path = Path(args.json)
    done = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    key = lambda r: (r["num_steps"], r["sde_type"], r["eta"])
    have = {key(r) for r in done}
    for r in regimes(args.steps, args.sde):
        if key(r) in have:
            continue
        recs = run_regime(r, args.set, args.batches, args.draws)
        with path.open("a") as f:
            for rec in recs:
                f.write(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                    for k, v in rec.items()}) + "\n")
        done += recs
        print(markdown(recs), flush=True)
    print("\n" + markdown(done))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
