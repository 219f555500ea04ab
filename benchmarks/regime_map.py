"""Where JAGG is nearly exact: ``jagg bench meter`` over a grid of sampling regimes (docs/RESULTS.md §6.1).

A regime is a step count, an SDE type with its noise level, and a trained (SDE) window. In each, on the job's own
checkpoint and batch (the main job, or ``--config``, with ``--set`` on top), :func:`jagg.bench.meter.measure`
measures the estimators' error against the update's noise on-policy, with the meter's per-update rate range
(:func:`jagg.bench.meter.prediction`), and the regime's **linearity score**: routing's score
(:func:`jagg.routing.linearity_scores`, the paper's linearity test, what ``jagg_frac`` ranks by) of the shipped
layout's intervals, averaged over the samples of ``--batches`` rollouts, with its lowest sample-interval mean. The
score needs only a rollout, so a user can read it on their model without a backward pass.

Estimators (``--estimator``, as ``jagg bench meter``'s; default): plain JAGG, step groups of 4 (the main job's
``config``), shared knots W = 4, unbiased JAGG (p 0.25) and random timestep subsampling at plain JAGG's rows.

Regimes (default, 17): 10 steps (trained 0-7) and 20 steps (trained 0-15), each with DanceGRPO's SDE at eta 0.3, 0.7
and 1.0, Flow-GRPO's at 0.3 and 1.0 and CPS at 0.3 and 0.7; and the main job's SDE (dance, eta 1) at 10 steps with the
trained window cut to steps 0-3 (the noisy end), 4-7 (the clean end) and 2-7.
Records go to ``--json`` (JSON lines, appended per regime, so an interrupted map resumes; a regime already there is
skipped) and a markdown table is printed; ``--summary`` prints the table of a finished map without measuring.

    python benchmarks/regime_map.py --json runs/regime_map.json                      # the whole grid
    python benchmarks/regime_map.py --steps 20 --json runs/regime_map.json           # a part of it (resumes)
    python benchmarks/regime_map.py --json runs/regime_map.json --summary            # the table and the rule's fit
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from jagg.bench.common import default_config_path, spearman
from jagg.bench.meter import kept_batch, layout_linearity, load_config, make_sampler, measure, spec_base

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


def overrides(r: dict) -> list[str]:
    return [f"sample.num_steps={r['num_steps']}", f"sample.sde_type={r['sde_type']}", f"sample.eta={r['eta']}",
            f"sample.sde_window={r['sde_window']}"]


def linearity(cfg, batches: int) -> dict:
    """Routing's linearity score of the config's layout over ``batches`` fresh rollouts
    (:func:`jagg.bench.meter.layout_linearity`), for a map whose estimators leave out ``config``."""
    sampler = make_sampler(cfg)
    return layout_linearity([kept_batch(sampler, cfg)[0] for _ in range(batches)], spec_base(cfg))


def run_regime(r: dict, config: str | None, sets: list[str], specs: list[str], batches: int, draws: int) -> list[dict]:
    cfg = load_config(config or default_config_path(), ["threads=1", *overrides(r), *sets])
    recs = measure(cfg, specs, batches, draws, None)
    scored = [rec for rec in recs if rec["estimator"] == "config"]      # the meter scored the config's layout on the
    lin = ({k: scored[0][k] for k in ("linearity", "linearity_min")} if scored    # very rollouts it measured
           else linearity(cfg, batches))
    return [{**r, **{k: v for k, v in rec.items() if k != "tensors"}, **lin} for rec in recs]   # the regime's score


def markdown(records: list[dict]) -> str:
    head = ("| steps | trained | SDE, eta | linearity (min) | estimator | rows/sample | E\\|e\\|^2/V_b (± SE) | bias z | "
            "rate/update |\n|---|---|---|---|---|---|---|---|---|")
    rows = [f"| {r['num_steps']} | {r['sde_window'][0]}-{r['sde_window'][1] - 1} | {r['sde_type']}, {r['eta']} | "
            f"{r['linearity']:.3f} ({r['linearity_min']:.2f}) | {r['estimator']} | {r['rows_per_sample']:.2f} | "
            f"{r['error_to_noise']:.3f} (± {r['error_to_noise_se']:.3f}) | {r['bias_z'] or 0:.1f} | "
            f"{r['prediction_range']} |" for r in records if r["estimator"] != "exact"]
    return "\n".join([head, *rows])


def summary(records: list[dict]) -> str:
    """How each estimator's error ranks with the regime's linearity score over the map (Spearman; negative: more
    linear, less error)."""
    lines = []
    for name in dict.fromkeys(r["estimator"] for r in records if r["estimator"] != "exact"):
        rs = [r for r in records if r["estimator"] == name]
        if len(rs) >= 3:
            rho = spearman([r["linearity"] for r in rs], [r["error_to_noise"] for r in rs])
            lines.append(f"{name}: Spearman(linearity, E|e|^2/V_b) = {rho:+.2f} over {len(rs)} regimes")
    return "\n".join(lines)


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="trainer YAML [default: the main job]")
    p.add_argument("--steps", type=int, nargs="+", choices=sorted(WINDOWS), default=sorted(WINDOWS))
    p.add_argument("--sde", nargs="+", choices=sorted(SDE_NOISE), default=list(SDE_NOISE))
    p.add_argument("--no-cuts", action="store_true", help="leave out the regimes with a cut trained window")
    p.add_argument("--estimator", action="append", metavar="NAME[:KEY=VALUE,...]",
                   help=f"an estimator, as jagg bench meter's (repeatable) [default: {' '.join(ESTIMATORS)}]")
    p.add_argument("--batches", type=int, default=6, help="independent batches per regime (>= 3) [default: 6]")
    p.add_argument("--draws", type=int, default=3, help="draws of a random estimator per batch [default: 3]")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="trainer config override")
    p.add_argument("--json", required=True, help="records (JSON lines; regimes already there are skipped)")
    p.add_argument("--summary", action="store_true", help="only print the table of the records in --json")
    args = p.parse_args(argv)
    path = Path(args.json)
    done = load(path)
    if args.summary:
        if not done:
            raise SystemExit(f"--summary: no records in {path}")
        print(markdown(done) + "\n\n" + summary(done))
        return 0
    if args.batches < 3 or args.draws < 1:
        raise SystemExit(f"--batches must be >= 3 and --draws >= 1; got {args.batches} and {args.draws}")
    have = {key(r) for r in done}
    for r in regimes(args.steps, args.sde, not args.no_cuts):
        if key(r) in have:
            continue
        recs = run_regime(r, args.config, args.set, args.estimator or ESTIMATORS, args.batches, args.draws)
        with path.open("a") as f:
            for rec in recs:
                f.write(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                    for k, v in rec.items()}) + "\n")
        done += recs
        print(markdown(recs), flush=True)
    print("\n" + markdown(done) + "\n\n" + summary(done))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
