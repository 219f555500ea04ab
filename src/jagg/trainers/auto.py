"""``estimator.mode: auto``: at a run's start, a pre-flight decides which estimator the run trains with.

The pre-flight (:func:`preflight`) measures exact and the config's candidates (``estimator.candidates``) on the run's
own sampler, model and reward, with the meter's measurement (:func:`jagg.trainers.metering.measure_positions`: the
same records as ``jagg bench meter --update all``) at every update position of a rollout, and decides with the meter's
verdict (:func:`jagg.verdict.verdict`): a candidate only when its range is known and the low end of its projected
progress per second clears exact's by ``estimator.preflight_margin`` at every position; otherwise exact. A candidate
that fails a position is not measured at the next ones. The pre-flight stays within ``estimator.preflight_share`` of
the run's projected CPU time: a run too short for it trains exact unmeasured, and positions the budget does not reach
count as unknown (exact's side).

It draws its batches with RNGs of its own (the run's seed moved by :data:`SEED_OFFSET`) and restores every RNG and
parameter it touched, so a run whose pre-flight chose exact trains exactly as an exact run of the same seed; its
seconds are added to the run's clocks (``wall_s``, ``cpu_s``). :class:`AutoEstimator` is the trainers' part:
the decision on the first screen, in ``preflight.json`` of the run directory and in a ``preflight`` metrics record,
and kept in the checkpoints, so that a resumed run trains on with it without measuring again.
"""

from __future__ import annotations

import random
import shlex
import time

import numpy as np
import torch

from ..infra.atomic import write_json
from ..cost import config_structure, default_cost, resolve
from ..checks import SEED_MAX
from ..estimator_config import EstimatorConfig
from ..infra.distributed import gather_objects
from ..verdict import position_failure, verdict
from .metering import measure_positions, restore_params
from .sections import auto_candidates, steps_source, trained_steps

SEED_OFFSET = 7_777_777          # the pre-flight's batches: seed + this, never a training stream of a nearby seed
RECORD_KEYS = ("estimator", "update", "rows_per_sample", "error_to_noise", "error_to_noise_se", "bias_to_noise",
               "bias_to_noise_se", "bias_z", "iter_ratio", "projected_iter_ratio", "train_s", "rollout_s", "clip_frac",
               "rate_lo", "rate_hi", "time_rate_lo", "time_rate_hi", "prediction", "prediction_range")


def preflight_seed(seed: int) -> int:
    """The seed of the pre-flight's own batches and picks for a run of ``seed``."""
    return (seed + SEED_OFFSET) % (SEED_MAX + 1)


def meter_command(cfg, seed: int) -> str:
    """The ``jagg bench meter`` command that makes the same measurement (its default size unless the pre-flight's is
    given; on the shapes world the same batches)."""
    e = cfg.estimator
    parts = ["jagg", "bench", "meter", "--set", f"seed={seed}", "--update", "all", "--batches",
             str(e.preflight_batches), "--draws", str(e.preflight_draws)]
    for spec in e.candidates:
        if spec != "exact":
            parts += ["--estimator", spec]
    return " ".join(shlex.quote(p) for p in parts) + " (with this run's --config and --set)"


def preflight(sampler, cfg, budget_note: list | None = None) -> dict:
    """Measure ``cfg.estimator``'s candidates on ``sampler`` (the run's own) and decide (module docstring). The
    sampler's RNGs are reseeded for it (:func:`preflight_seed`); the caller restores them. Returns the decision:
    ``train_with`` (a name), ``estimator`` (its config as a dict), ``reason``, ``line``, ``lines``, ``candidates``
    (:func:`jagg.verdict.verdict`'s), the measurement's size (``batches``, ``draws``, ``updates``, ``measured_updates``,
    ``seed``), ``command`` (:func:`meter_command`) and ``records`` (the meter's, per candidate and position)."""
    c, e = cfg, cfg.estimator
    pipeline = getattr(c, "pipeline", None)                # a diffusers config's steps are the pipeline's
    num_steps, key = (pipeline.num_steps, "pipeline.num_steps") if pipeline else (c.sample.num_steps, "sample.num_steps")
    ests, left_out = auto_candidates(e, trained_steps(c.sample, num_steps), steps_source(c.sample, key, num_steps))
    updates = c.grpo.inner_epochs * c.grpo.updates_per_epoch
    seed = preflight_seed(c.seed)
    out = {"batches": e.preflight_batches, "draws": e.preflight_draws, "updates": updates, "seed": seed,
           "left_out": left_out,
           "margin": e.preflight_margin, "command": meter_command(c, seed), "records": [], "measured_updates": 0}
    if len(ests) == 1 or c.grpo.iterations * e.preflight_share < e.preflight_batches:
        why = ("no candidate besides exact (estimator.candidates)" if len(ests) == 1 else
               f"the run ({c.grpo.iterations} iterations) is too short for a pre-flight of {e.preflight_batches} "
               f"batches within estimator.preflight_share={e.preflight_share:g} of its time: raise grpo.iterations or "
               "estimator.preflight_share, or choose estimator.mode")
        return {**out, "train_with": "exact", "estimator": ests["exact"].to_dict(), "reason": why,
                "line": f"train with exact: {why}", "lines": [], "candidates": []}
    sampler.gen.manual_seed(seed)
    sampler.np_rng.bit_generator.state = np.random.default_rng(seed).bit_generator.state
    cost = resolve(None, config_structure(c), None, default_cost(c))[0]
    c0, ran_out = time.process_time(), []

    def after(u: int, records: list[dict], alive: dict) -> dict | None:
        """The candidates that cleared update ``u``, if the budget allows the next position, else None."""
        by_name = {r["estimator"]: r for r in records}
        keep = {n: est for n, est in alive.items() if n == "exact" or position_failure(by_name[n], e.preflight_margin)
                is None}
        if len(keep) == 1 or u + 1 == updates:
            return None
        ex = by_name["exact"]
        run = c.grpo.iterations * (ex["rollout_s"] + ex["train_s"])       # the run's projected CPU seconds, exact
        spent = time.process_time() - c0
        coming = spent / (u + 1) * len(keep) / len(alive)                  # a position's cost, for the survivors
        if spent + coming > e.preflight_share * run:
            ran_out.append(u + 1)
            return None
        return keep

    per_update = measure_positions(sampler, c, ests, e.preflight_batches, e.preflight_draws, updates, seed,
                                   cost=cost, after=after)
    records = [r for recs in per_update for r in recs]
    missing = (f"the pre-flight's budget, estimator.preflight_share={e.preflight_share:g} of the run's projected "
               f"time, ran out before update {ran_out[0]}" if ran_out else "not measured")
    v = verdict(records, updates, e.preflight_margin, cost.name, missing)
    return {**out, "train_with": v["estimator"], "estimator": ests[v["estimator"]].to_dict(),
            **{k: v[k] for k in ("reason", "line", "lines", "candidates")}, "measured_updates": len(per_update),
            "records": [{k: r.get(k) for k in RECORD_KEYS} for r in records]}


class AutoEstimator:
    """``estimator.mode: auto`` in a trainer (a :class:`jagg.trainers.base.GRPO` with a ``sampler``, mixed in before
    it): :meth:`decide_estimator`, which the loop calls before the first iteration."""

    def decide_estimator(self) -> None:
        """Set :attr:`estimator` (the estimator the run trains with) and :attr:`decision`: a resumed run's, kept from
        its checkpoint; else the :func:`preflight`'s on this run's sampler (every RNG, parameter and gradient it
        touches restored; on several processes every one measures its share and the main process decides), its
        seconds added to the run's clocks, and the decision shown and recorded (:meth:`record_decision`)."""
        if self.decision is not None:
            self.estimator = EstimatorConfig.from_dict(self.decision["estimator"])
            self._print(f"estimator.mode auto: training with {self.decision['train_with']}, the pre-flight's decision "
                        "at the run's start (kept on resume)")
            return
        self._print("estimator.mode auto: the pre-flight measures exact and the candidates on this run's model and "
                    "reward ...")
        t0, c0 = time.perf_counter(), time.process_time()
        saved = _rng_state(self.sampler)
        params = [p.detach().clone() for p in self.params]
        try:
            decision = preflight(self.sampler, self.cfg)
        finally:
            restore_params(self.sampler, params)
            for p in self.params:
                p.grad = None
            _set_rng_state(self.sampler, saved)
        decision = gather_objects([decision])[0] if self.world > 1 else decision      # the main process decides
        decision["seconds"], decision["cpu_seconds"] = time.perf_counter() - t0, time.process_time() - c0
        self.wall += decision["seconds"]                 # the pre-flight is part of the run's cost
        self.cpu += decision["cpu_seconds"]
        self.estimator = EstimatorConfig.from_dict(decision["estimator"])
        self.decision = {k: v for k, v in decision.items() if k not in ("records", "lines", "candidates")}
        self.record_decision(decision)

    def record_decision(self, decision: dict) -> None:
        """The decision on the first screen, in ``preflight.json`` of the run directory and as the ``preflight``
        metrics record (iteration 0; main process)."""
        if not self.main:
            return
        size = (f"{decision['batches']} batches x {decision['draws']} draws, {decision['measured_updates']} of "
                f"{decision['updates']} update position(s)" if decision["measured_updates"] else "nothing measured")
        self._print(f"pre-flight: {size}, {decision['seconds']:.0f} s ({decision['cpu_seconds']:.0f} CPU s, counted "
                    "in the run's clocks)")
        for line in decision["lines"]:
            self._print(f"  {line}")
        for name, why in decision.get("left_out", {}).items():
            self._print(f"  {name}: left out of the default candidates here: {why}")
        self._print(decision["line"])
        if decision["measured_updates"]:
            self._print(f"  the same measurement: {decision['command']}")
        out = getattr(self, "out", None)
        if out is not None:
            write_json(out / "preflight.json", decision)
        if getattr(self, "logger", None) is not None:
            best = max(decision["candidates"], key=lambda c: c.get("time_rate_lo", -1.0), default={})
            self.logger.log({"kind": "preflight", "iteration": self.iteration, "train_with": decision["train_with"],
                             "reason": decision["reason"], "preflight_s": decision["seconds"],
                             "preflight_cpu_s": decision["cpu_seconds"], "measured_updates": decision["measured_updates"],
                             "best_candidate": best.get("estimator"), "best_time_rate_lo": best.get("time_rate_lo"),
                             "best_time_rate_hi": best.get("time_rate_hi"), "wall_s": self.wall, "cpu_s": self.cpu})


def _rng_state(sampler) -> dict:
    """Every RNG the pre-flight may move: the sampler's prompt and noise RNGs, its count of batches drawn (a
    diffusers sampler's SDE noise), and the global ones."""
    return {"gen": sampler.gen.get_state(), "numpy": sampler.np_rng.bit_generator.state,
            "sampled": getattr(sampler, "sampled", None), "torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(sampler, state: dict) -> None:
    sampler.gen.set_state(state["gen"])
    sampler.np_rng.bit_generator.state = state["numpy"]
    if state["sampled"] is not None:
        sampler.sampled = state["sampled"]
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])
