"""``estimator.mode: auto``: the run decides which estimator it trains with while it trains.

Its first ``estimator.preflight_batches`` iterations are exact's own: exact's updates on their own rollouts and
minibatches (``grpo.minibatches``, the cut the candidates would train on), and beside each update, on the same minibatch
at the same parameters, the gradients of the candidates (``estimator.candidates``). Exact's gradients train, so the
measurement costs only the candidates' rows and no exact progress is lost: a run whose measurement picks exact is,
update for update, an exact run from iteration 0. Every update position of the rollout (the on-policy first update and
the off-policy ones after it) is measured once per iteration, and the meter's records of each position
(:func:`jagg.trainers.side_by_side.position_records`: the error against the update's noise across the measured
iterations, and the iteration ratio measured beside it) go to the meter's verdict (:func:`jagg.verdict.verdict`): a
candidate only when its range is known and its low end clears exact's progress per second by
``estimator.preflight_margin`` at every position; otherwise exact.

The measurement is sized to the run: after its first iteration it goes on only while what is left of it costs less
than a candidate that clears the margin could win back in the run's remaining iterations, and at most
``estimator.preflight_share`` of the run's projected time; otherwise the run trains exact, saying why. It is also
sized to the machine: the gradients it holds (one per estimator draw, update position and measured iteration, each
gathered whole on every process) may take at most half its memory, or the run trains exact unmeasured. A chosen
candidate is re-measured beside exact every ``estimator.meter_every`` iterations (0: never), on the last
``preflight_batches`` measured iterations, and dropped for exact, with a record, when it no longer clears the bar.

The decision is on the first screen, in ``preflight.json`` of the run directory and in a ``preflight`` metrics record
(a switch back to exact in an ``auto_switch`` record), and kept in the checkpoints, so that a resumed run trains on with
it; a run stopped while measuring measures again from where it resumes. The candidates' picks (unbiased JAGG's) use a
generator of their own, so the trained updates' random streams are the trained estimator's alone.
"""

from __future__ import annotations

import math
import shlex
import statistics
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import Tensor

from ..cost import config_structure, default_cost, resolve
from ..estimator_config import EstimatorConfig
from ..infra.atomic import write_json
from ..infra.distributed import gather_objects, local_processes
from ..infra.sizes import FLOAT, held_over_half
from ..verdict import position_failure, signal_note, verdict
from .side_by_side import layout_linearity, position_records
from .sections import auto_candidates, steps_source, trained_steps

RECORD_KEYS = ("estimator", "update", "rows_per_sample", "error_to_noise", "error_to_noise_se", "bias_to_noise",
               "bias_to_noise_se", "bias_z", "signal_to_noise", "signal_to_noise_se", "iter_ratio",
               "projected_iter_ratio", "train_s", "rollout_s", "clip_frac", "rate_lo", "rate_hi", "time_rate_lo",
               "time_rate_hi", "prediction", "prediction_range")
PICK_SEED = 7_777_777                     # the candidates' picks: seed + this, never a training stream of a nearby seed


def pick_seed(seed: int, rank: int = 0) -> int:
    """The seed of the candidates' picks on process ``rank``: each process its own, as the trained estimator's (a
    process picks among its own samples' units), so a random candidate is measured with the picks it would train
    with; the main process's is ``seed +`` :data:`PICK_SEED`."""
    return seed + PICK_SEED + 104_729 * rank


def meter_command(cfg) -> str:
    """The ``jagg bench meter`` command that measures the same candidates on the same batching before a run (to
    decide once for a job trained many times)."""
    e = cfg.estimator
    parts = ["jagg", "bench", "meter", "--update", "all", "--batches", str(e.preflight_batches), "--draws",
             str(e.preflight_draws)]
    for spec in e.candidates:
        if spec != "exact":
            parts += ["--estimator", spec]
    return " ".join(shlex.quote(p) for p in parts) + " (with this run's --config and --set)"


def whole_grad(params: list) -> Tensor:
    """All ``.grad`` as one float32 vector ``[P]`` on the host (zeros where a grad is None), a sharded gradient (FSDP's
    ``DTensor``) gathered whole first: a collective, so every process calls it, in the same order."""
    parts = []
    for p in params:
        g = p.grad
        g = torch.zeros(p.shape) if g is None else g.full_tensor() if hasattr(g, "full_tensor") else g
        parts.append(g.detach().flatten().float().cpu())
    return torch.cat(parts)


@dataclass
class Measurement:
    """What auto has measured: per update position ``u``, per estimator, one entry per measured iteration.

    Attributes:
        ests: the estimators measured, exact first (``{name: config}``).
        trained: the name of the estimator whose gradients train (exact while deciding, the chosen one after).
        grads: ``[U]`` of ``{name: [[draws, P] float32, ...]}``, the flat gradients on each measured minibatch.
        costs: ``[U]`` of ``{name: [[(CPU seconds, rows, no-grad rows per sample, clip fraction) per draw], ...]}``.
        sizes, linearity: ``[U]`` the measured minibatches' sizes, and per estimator their layouts' linearity.
        rollout_s: the measured iterations' rollout CPU seconds per update.
        beside_s: the CPU seconds the estimators measured beside the trained one cost, per measured iteration.
        iterations: the measured iterations (0-based).
    """

    ests: dict[str, EstimatorConfig]
    trained: str
    updates: int
    grads: list[dict] = field(default_factory=list)
    costs: list[dict] = field(default_factory=list)
    sizes: list[list[int]] = field(default_factory=list)
    linearity: list[dict] = field(default_factory=list)
    rollout_s: list[float] = field(default_factory=list)
    beside_s: list[float] = field(default_factory=list)
    iterations: list[int] = field(default_factory=list)
    measured: list[list[int]] = field(default_factory=list)      # [U] the iteration of each measured minibatch

    def __post_init__(self):
        for _ in range(self.updates):
            self.measured.append([])
            self.grads.append({n: [] for n in self.ests})
            self.costs.append({n: [] for n in self.ests})
            self.sizes.append([])
            self.linearity.append({n: [] for n in self.ests})

    def keep_last(self, k: int) -> None:
        """Forget all but the last ``k`` measured iterations (a re-measurement's rolling window)."""
        drop = max(len(self.iterations) - k, 0)
        if not drop:
            return
        old = set(self.iterations[:drop])
        self.iterations, self.rollout_s, self.beside_s = (x[drop:] for x in (self.iterations, self.rollout_s,
                                                                              self.beside_s))
        for u in range(self.updates):
            keep = [i for i, it in enumerate(self.measured[u]) if it not in old]
            self.measured[u] = [self.measured[u][i] for i in keep]
            self.sizes[u] = [self.sizes[u][i] for i in keep]
            for n in self.ests:
                for part in (self.grads, self.costs, self.linearity):
                    part[u][n] = [part[u][n][i] for i in keep]

    def add(self, u: int, iteration: int, name: str, grads: Tensor, costs: list[tuple], size: int,
            linearity: dict) -> None:
        """One estimator's measurement on the minibatch of update ``u`` in ``iteration`` (exact's first)."""
        if name == next(iter(self.ests)):
            self.measured[u].append(iteration)
            self.sizes[u].append(size)
        self.grads[u][name].append(grads)
        self.costs[u][name].append(costs)
        self.linearity[u][name].append(linearity)

    def records(self, cfg, params: tuple[list, list[str]], cost, draws: int = 1) -> list[dict]:
        """The meter's records of every position measured on at least 3 minibatches; an estimator no longer measured
        (pruned) is judged on its own minibatches, against exact's on the same ones; ``draws``: a random
        candidate's per update."""
        out = []
        share = statistics.median(self.rollout_s) if self.rollout_s else 0.0
        for u in range(self.updates):
            counts = {n: len(self.grads[u][n]) for n in self.ests}
            for k in sorted({c for c in counts.values() if c >= 3}, reverse=True):
                names = ["exact"] + [n for n in self.ests if n != "exact" and counts[n] == k]
                if k < counts["exact"] and len(names) == 1:
                    continue
                ests = {n: self.ests[n] for n in names}
                lin = {n: {key: _nanmean([x[key] for x in self.linearity[u][n][:k]])
                           for key in ("linearity", "linearity_min")} for n in names}
                costs = {n: [c for per in self.costs[u][n][:k] for c in per] for n in names}
                grads = {n: self.grads[u][n][:k] for n in names}
                recs = position_records(cfg, ests, grads, costs, [share], self.sizes[u][:k], lin, u, params,
                                        draws, round(statistics.fmean(self.sizes[u][:k])), cost)
                out += [r for r in recs if r["estimator"] != "exact" or k == counts["exact"]]
        return out


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if v == v]
    return statistics.fmean(finite) if finite else float("nan")


class AutoEstimator:
    """``estimator.mode: auto`` in a trainer (a :class:`jagg.trainers.loop.GRPO`, mixed in before it): the hooks the
    loop calls: :meth:`decide_estimator` before the first iteration, :meth:`beside` after each update's gradient and
    :meth:`iteration_done` after each iteration (module docstring)."""

    measurement: Measurement | None = None

    def decide_estimator(self) -> None:
        """Set :attr:`estimator`: a resumed run's decision, kept from its checkpoint; else exact, measured beside the
        candidates from this iteration on (or unmeasured where the run is too short or nothing is to be measured)."""
        c, e = self.cfg, self.cfg.estimator
        if self.decision is not None:
            self.estimator = EstimatorConfig.from_dict(self.decision["estimator"])
            self._print(f"estimator.mode auto: training with {self.decision['train_with']}, the decision of the run's "
                        "measurement (kept on resume)")
            if self.decision["train_with"] != "exact" and e.meter_every:
                self.measurement = self._new_measurement(self.decision["train_with"])
            return
        self._candidates()
        self.estimator = self._ests["exact"]
        self._measure_cpu = 0.0
        left = c.grpo.iterations - self.iteration
        if len(self._ests) == 1:
            why = "no candidate besides exact (estimator.candidates)"
        elif left <= e.preflight_batches:
            why = (f"the run's {left} remaining iterations leave none to train a candidate in after measuring "
                   f"{e.preflight_batches} (estimator.preflight_batches): raise grpo.iterations, or choose "
                   "estimator.mode")
        else:
            why = self._too_large()
        if why is not None:
            self._decide({"train_with": "exact", "reason": why, "line": f"train with exact: {why}", "lines": [],
                          "candidates": []}, [])
            return
        self.measurement = self._new_measurement("exact")
        self._print(f"estimator.mode auto: the first {e.preflight_batches} iterations train exact and measure "
                    f"{', '.join(n for n in self._ests if n != 'exact')} beside each of exact's updates, on the same "
                    f"minibatches ({self.cfg.cut_for(self.world)}); only the candidates' rows are extra")

    def _candidates(self) -> None:
        """``_ests`` (exact and the candidates that fit the job's trained steps) and ``_left_out`` (the default
        candidates that do not, with why)."""
        c = self.cfg
        pipeline = getattr(c, "pipeline", None)            # a diffusers config's steps are the pipeline's
        num_steps, key = (pipeline.num_steps, "pipeline.num_steps") if pipeline else (c.sample.num_steps,
                                                                                      "sample.num_steps")
        self._ests, self._left_out = auto_candidates(c.estimator, trained_steps(c.sample, num_steps),
                                                     steps_source(c.sample, key, num_steps))

    def _too_large(self) -> str | None:
        """Why the measurement's gradients cannot be held in this machine's memory, or None. It holds one flat
        float32 gradient per estimator (a random one's ``preflight_draws``), update position and measured iteration, on
        the host of every process: it may take at most half the machine's memory (the processes on it together)."""
        e, g = self.cfg.estimator, self.cfg.grpo
        vectors = e.preflight_batches * g.inner_epochs * g.updates_per_epoch * sum(
            e.preflight_draws if est.random else 1 for est in self._ests.values())
        numel = sum(p.numel() for p in self.params)
        processes = local_processes(self.world)
        why = held_over_half(float(vectors) * numel * FLOAT * processes,
                             f"measuring holds {vectors} flat gradients of the {numel:,} trainable parameters on the "
                             f"host ({e.preflight_batches} iterations x {g.inner_epochs * g.updates_per_epoch} update "
                             f"positions x the estimators' draws{f', x {processes} processes' if processes > 1 else ''})")
        return None if why is None else (f"{why}; train a LoRA (pipeline.lora), lower estimator.preflight_batches or "
                                         "estimator.candidates, or decide once with jagg bench meter on a LoRA of the "
                                         "job (a proxy)")

    def _new_measurement(self, trained: str) -> Measurement:
        """A measurement of exact and the candidates (``trained``: exact) or of exact beside the chosen one."""
        if not hasattr(self, "_ests"):
            self._candidates()
        ests = self._ests if trained == "exact" else {"exact": self._ests["exact"], trained: self._ests[trained]}
        g = self.cfg.grpo
        self._pick_gen = torch.Generator().manual_seed(pick_seed(self.cfg.seed, getattr(self, "rank", 0)))
        return Measurement(ests, trained, g.inner_epochs * g.updates_per_epoch)

    def audit_due(self) -> bool:
        """mode auto re-measures its choice itself (``estimator.meter_every``): no separate audit."""
        return False if self.cfg.estimator.mode == "auto" else super().audit_due()

    def measuring_now(self) -> bool:
        """Whether this iteration's updates are measured: every iteration until the decision, then every
        ``estimator.meter_every``-th while a candidate trains."""
        m = self.measurement
        if m is None:
            return False
        if m.trained == "exact":
            return True
        every = self.cfg.estimator.meter_every
        return bool(every) and (self.iteration + 1) % every == 0

    def beside(self, mb, stats: dict, cpu: float) -> None:
        """After the trained estimator's gradient of ``mb`` (in ``.grad``; ``stats``, ``cpu``: its statistics and
        CPU seconds): in a measured iteration, every other measured estimator's gradient of the same minibatch at the
        same parameters, then the trained gradient restored. Every process measures, those without a sample in this
        minibatch too (their share of each gradient's collectives), on the minibatch's samples over all processes
        (``stats["samples"]``)."""
        if not self.measuring_now():
            return
        m, c0 = self.measurement, time.process_time()
        kept = [None if p.grad is None else p.grad.detach().clone() for p in self.params]
        n = max(int(stats.get("samples", mb.size)), 1)
        per = {m.trained: (whole_grad(self.params)[None], [(cpu, stats["backward_items"] / n,
                                                            stats["forward_nograd_items"] / n, stats["clip_frac"])])}
        trained_est, trained_gen = self.estimator, self.pick_gen
        try:
            for name, est in m.ests.items():
                if name == m.trained or name in getattr(self, "_pruned", ()):
                    continue
                gs, cs = [], []
                for _ in range(self.cfg.estimator.preflight_draws if est.random else 1):
                    self.opt.zero_grad(set_to_none=True)
                    self.estimator, self.pick_gen = est, self._pick_gen
                    c1 = time.process_time()
                    st = self.gradient(mb)
                    cs.append((time.process_time() - c1, st["backward_items"] / n, st["forward_nograd_items"] / n,
                               st["clip_frac"]))
                    gs.append(whole_grad(self.params))             # held on the host
                per[name] = (torch.stack(gs), cs)
        finally:
            self.estimator, self.pick_gen = trained_est, trained_gen
            for p, g in zip(self.params, kept):
                p.grad = g
        u = mb.position
        for name in (k for k in m.ests if k in per):         # exact first
            lin = (layout_linearity([SimpleNamespace(traj=mb.traj)], m.ests[name]) if mb.traj is not None else
                   {"linearity": math.nan, "linearity_min": math.nan})          # none of this process's samples
            m.add(u, self.iteration, name, *per[name], n, lin)
        self._measure_cpu += time.process_time() - c0
        self._measured_this = True

    def iteration_done(self, rollout_cpu: float, iteration_cpu: float) -> None:
        """After an iteration (its rollout's and its own CPU seconds): note what it measured; decide when the
        measurement is complete, stop it when the run cannot win its cost back, and re-check a chosen candidate."""
        m = self.measurement
        if m is None or not getattr(self, "_measured_this", False):
            return
        self._measured_this = False
        e, g = self.cfg.estimator, self.cfg.grpo
        self._last_iteration_cpu = iteration_cpu
        m.iterations.append(self.iteration - 1)
        m.rollout_s.append(rollout_cpu / (g.inner_epochs * g.updates_per_epoch))
        m.beside_s.append(self._measure_cpu)
        self._measure_cpu = 0.0
        if m.trained == "exact":
            if len(m.iterations) == 1 and (why := self._too_costly()) is not None:
                self._decide({"train_with": "exact", "reason": why, "line": f"train with exact: {why}", "lines": [],
                              "candidates": []}, [])
            elif len(m.iterations) >= e.preflight_batches or not self._prune():
                self._decide_from_records()
            return
        m.keep_last(e.preflight_batches)
        self._recheck()

    def _too_costly(self) -> str | None:
        """Why the rest of the measurement cannot pay for itself (from its first iteration), or None."""
        e, m = self.cfg.estimator, self.measurement
        spent = m.beside_s[0]
        iteration = self._last_iteration_cpu - spent                # exact's own CPU seconds of that iteration
        rest = (e.preflight_batches - 1) * spent
        remaining = self.cfg.grpo.iterations - self.iteration - (e.preflight_batches - 1)
        win = e.preflight_margin / (1 + e.preflight_margin) * remaining * iteration
        budget = e.preflight_share * self.cfg.grpo.iterations * iteration
        if rest <= win and rest + spent <= budget:
            return None
        return (f"measuring the candidates costs {spent:.1f} CPU s per iteration beside exact's {iteration:.1f} s; "
                f"the {e.preflight_batches - 1} more iterations it needs ({rest:.0f} s) cost more than a candidate "
                f"{1 + e.preflight_margin:.2f} x as fast could win back in the run's {remaining} remaining iterations "
                f"({win:.0f} s), or than estimator.preflight_share={e.preflight_share:g} of the run ({budget:.0f} s): "
                "a longer run measures, or decide once with jagg bench meter")

    def _prune(self) -> bool:
        """From the third measured iteration on, stop measuring the candidates whose projected progress per second
        cannot clear the bar even at the high end of its range at some position (their measurements are kept for the
        verdict); whether any candidate is still measured."""
        m = self.measurement
        if len(m.iterations) < 3:
            return True
        records, _ = self._records()
        bar = 1 + self.cfg.estimator.preflight_margin
        out = {r["estimator"] for r in records if r["estimator"] != "exact" and r["prediction"] == "range"
               and not r["time_rate_hi"] >= bar}
        out = gather_objects([sorted(out)])[0] if self.world > 1 else sorted(out)
        self._pruned = sorted(set(getattr(self, "_pruned", [])) | set(out))
        return any(n not in self._pruned for n in m.ests if n != "exact")

    def _params(self) -> tuple[list, list[str]]:
        return self.params, self.sampler.param_names

    def _records(self) -> tuple[list[dict], object]:
        cost = resolve(None, config_structure(self.cfg), None, default_cost(self.cfg))[0]
        return self.measurement.records(self.cfg, self._params(), cost, self.cfg.estimator.preflight_draws), cost

    def _decide_from_records(self) -> None:
        records, cost = self._records()
        m = self.measurement
        v = verdict(records, m.updates, self.cfg.estimator.preflight_margin, cost.name, "fewer than 3 minibatches "
                    "measured there")
        self._decide(v, records)

    def _decide(self, v: dict, records: list[dict]) -> None:
        """Train with ``v["train_with"]`` (or the verdict's ``estimator``) from the next iteration on; show and
        record the decision (the main process's, on every process)."""
        m, e = self.measurement, self.cfg.estimator
        name = v.get("train_with") or v["estimator"]
        note = signal_note(records)
        decision = {"train_with": name, "estimator": self._ests[name].to_dict(), "reason": v["reason"],
                    "line": v["line"], "lines": v["lines"] + ([note] if note else []), "candidates": v["candidates"],
                    "measured_iterations": len(m.iterations) if m else 0, "updates": m.updates if m else
                    self.cfg.grpo.inner_epochs * self.cfg.grpo.updates_per_epoch,
                    "measured_updates": len({r["update"] for r in records}), "minibatches": self.cfg.cut_for(self.world),
                    "estimators": list(self._ests), "left_out": self._left_out, "margin": e.preflight_margin,
                    "cpu_seconds": sum(m.beside_s) if m else 0.0, "iteration": self.iteration,
                    "command": meter_command(self.cfg), "records": [{k: r.get(k) for k in RECORD_KEYS}
                                                                    for r in records]}
        decision = gather_objects([decision])[0] if self.world > 1 else decision      # the main process decides
        self._pruned = []
        self.estimator = EstimatorConfig.from_dict(decision["estimator"])
        decision["minibatches_after"] = self.cfg.cut_for(self.world, self.estimator.mode)
        self.decision = {k: v for k, v in decision.items() if k not in ("records", "lines", "candidates")}
        self.measurement = self._new_measurement(name) if name != "exact" and e.meter_every else None
        if self.measurement is not None:                     # the re-measurement starts from what was measured
            self.measurement = _carry(m, self.measurement)
        self.record_decision(decision)

    def _recheck(self) -> None:
        """Re-measure the chosen candidate: drop it for exact when a position no longer clears the bar."""
        m = self.measurement
        if len(m.iterations) < 3:
            return
        records, _ = self._records()
        fail = next(((r["update"], why) for r in records if r["estimator"] == m.trained
                     and (why := position_failure(r, self.cfg.estimator.preflight_margin)) is not None), None)
        fail = gather_objects([fail])[0] if self.world > 1 else fail
        if fail is None:
            return
        why = f"{m.trained} re-measured at iteration {self.iteration}: update {fail[0]}: {fail[1]}"
        self._print(f"estimator.mode auto: training with exact from now on: {why}")
        self.estimator = self._ests["exact"]
        self.decision = {**self.decision, "train_with": "exact", "estimator": self.estimator.to_dict(),
                         "switched": {"iteration": self.iteration, "from": m.trained, "why": why}}
        self.measurement = None
        if getattr(self, "logger", None) is not None:
            self.logger.log({"kind": "auto_switch", "iteration": self.iteration, "from": m.trained,
                             "train_with": "exact", "reason": why, "wall_s": self.wall, "cpu_s": self.cpu})

    def record_decision(self, decision: dict) -> None:
        """The decision on the screen, in ``preflight.json`` of the run directory and as the ``preflight`` metrics
        record (main process)."""
        if not self.main:
            return
        k = decision["measured_iterations"]
        size = (f"{k} iterations x {decision['measured_updates']} of {decision['updates']} update position(s), "
                f"on minibatches of {decision['minibatches']}" if k else "nothing measured")
        self._print(f"estimator.mode auto: measured {size}; the candidates beside exact cost "
                    f"{decision['cpu_seconds']:.0f} CPU s (counted in the run's clocks)")
        for line in decision["lines"]:
            self._print(f"  {line}")
        for name, why in decision.get("left_out", {}).items():
            self._print(f"  {name}: left out of the default candidates here: {why}")
        self._print(decision["line"] + (f" (from iteration {decision['iteration'] + 1})" if k else ""))
        if decision["minibatches_after"] != decision["minibatches"]:
            self._print(f"  its updates cut {decision['minibatches_after']} from then on (grpo.minibatches auto: the "
                        f"measurement cut {decision['minibatches']}, the candidates' batching)")
        out = getattr(self, "out", None)
        if out is not None:
            write_json(out / "preflight.json", decision)
        if getattr(self, "logger", None) is not None:
            best = max(decision["candidates"], key=lambda c: c.get("time_rate_lo", -1.0), default={})
            self.logger.log({"kind": "preflight", "iteration": self.iteration, "train_with": decision["train_with"],
                             "reason": decision["reason"], "preflight_cpu_s": decision["cpu_seconds"],
                             "measured_iterations": k, "measured_updates": decision["measured_updates"],
                             "minibatches": decision["minibatches"],
                             "best_candidate": best.get("estimator"), "best_time_rate_lo": best.get("time_rate_lo"),
                             "best_time_rate_hi": best.get("time_rate_hi"), "wall_s": self.wall, "cpu_s": self.cpu})


def _carry(old: Measurement | None, new: Measurement) -> Measurement:
    """``new`` (exact and the chosen candidate) holding what ``old`` measured of them."""
    if old is None:
        return new
    for u in range(new.updates):
        for n in new.ests:
            new.grads[u][n] = list(old.grads[u][n])
            new.costs[u][n] = list(old.costs[u][n])
            new.linearity[u][n] = list(old.linearity[u][n])
        new.sizes[u] = list(old.sizes[u])
        new.measured[u] = list(old.measured[u])
    new.iterations, new.rollout_s, new.beside_s = list(old.iterations), list(old.rollout_s), list(old.beside_s)
    return new
