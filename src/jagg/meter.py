"""The meter: an estimator's error against the noise one GRPO update already carries, and what it predicts for
learning per update and per second against exact (docs/design.md §3.8).

A GRPO update is noise-dominated: the exact gradients of independent batches barely agree. So what an estimator's
error costs is measured against that noise, not against the gradient: an unbiased error adds to the update's
variance (``V_b + E|e|^2``), a repeating one (a bias) is integrated by Adam like a signal. :func:`error_noise_stats`
measures both from gradients of several batches (``jagg bench meter``); :class:`Meter` keeps running estimates over a
training run's audits (the trainers' ``estimator.meter_every``); the efficiency models turn them into predictions.
"""

from __future__ import annotations

import copy
import math
import statistics
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .checks import (as_vector, check_count, check_fields, check_finite_tensor, check_number, check_positive,
                     check_tensor, is_finite_number)


def _check_ratios(work_ratio, error_to_noise) -> None:
    """``work_ratio`` a finite number > 0; ``error_to_noise`` a finite number >= 0 (a mean square over a variance),
    or NaN: not measured (the batches' exact gradients had no noise to compare the error with)."""
    check_number(work_ratio, "work_ratio", 0.0, strict=True, why="exact's rows or time over the estimator's")
    if not (isinstance(error_to_noise, float) and math.isnan(error_to_noise)):
        check_number(error_to_noise, "error_to_noise", 0.0, why="E|e|^2 / V_b, or NaN: not measured")


def _rate(work_ratio: float, error_to_noise: float, power: float) -> float:
    """``work_ratio / (1 + error_to_noise)^power`` unchecked, for the meter's own running estimates: NaN where the
    error is not measured yet (no noise to compare it with)."""
    return math.nan if math.isnan(error_to_noise) else work_ratio / (1.0 + max(error_to_noise, 0.0)) ** power


def predicted_efficiency(work_ratio: float, error_to_noise: float) -> float:
    """``work_ratio / (1 + error_to_noise)``: progress for the same work against exact for an estimator whose update
    carries ``V_b + E|e|^2`` of variance instead of ``V_b`` (docs/design.md §3). ``work_ratio`` = exact's rows (or
    time) / the estimator's, a finite number > 0; ``error_to_noise`` a finite number >= 0, or NaN where it was not
    measured (no noise), which gives NaN: no rate."""
    _check_ratios(work_ratio, error_to_noise)
    return _rate(float(work_ratio), float(error_to_noise), 1.0)


def adam_efficiency(work_ratio: float, error_to_noise: float) -> float:
    """``work_ratio / sqrt(1 + error_to_noise)``: the same for an optimizer that normalises the update by the
    gradient's own scale (Adam, whose second moment is set by the noise when the update is noise-dominated; or a
    gradient-norm clip that is always active). Its expected step is the signal divided by ``sqrt(V_b + E|e|^2)`` and
    the noise's second-order cost is normalised away, so extra unbiased error costs its square root
    (docs/design.md §3.8). Valid for an unbiased estimator only: a repeating error enters the step at full weight.
    The arguments as :func:`predicted_efficiency`'s."""
    _check_ratios(work_ratio, error_to_noise)
    return _rate(float(work_ratio), float(error_to_noise), 0.5)


def _numbers(values, name: str) -> np.ndarray:
    """``values`` (a sequence, array or tensor of numbers) as a flat float64 array; a TypeError naming ``name``
    otherwise."""
    return as_vector(values, name, np.float64).double().cpu().numpy()


# Adam's per-tensor model (docs/design.md §3.8): below this z the signal counts as unmeasured and each tensor is
# weighted as if its coordinates had the same signal-to-noise ratio
SIGNAL_Z = 2.0


def tensor_weights(noise: Sequence[float], numel: Sequence[int], signal: Sequence[float] | None = None) -> np.ndarray:
    """Each parameter tensor's share of Adam's progress along the signal, ``sum_{j in t} s_j^2 / sqrt(V_j)`` over its
    coordinates (``s_j`` the signal, ``V_j`` the noise, which sets Adam's second moment in a noise-dominated update),
    from per-tensor totals with the noise spread evenly inside a tensor (``V_j = V_t / n_t``).

    Args:
        noise: ``[T]`` each tensor's noise ``V_t`` (its coordinates' variances summed).
        numel: ``[T]`` each tensor's number of coordinates ``n_t``.
        signal: ``[T]`` each tensor's squared signal ``|E g_t|^2`` where it is measured (estimates below 0 count as
            0), or None: then every coordinate is taken to have the same signal-to-noise ratio (``s_j^2`` in proportion
            to ``V_j``).

    Returns:
        ``[T]`` weights summing to 1: ``|E g_t|^2 sqrt(n_t / V_t)`` with a signal, ``sqrt(n_t V_t)`` without (0 for
        a tensor without noise). All zero when no tensor has a weight.
    """
    V, n = _numbers(noise, "noise"), _numbers(numel, "numel")
    if V.shape != n.shape or (signal is not None and _numbers(signal, "signal").shape != V.shape):
        raise ValueError(f"noise, numel (and signal) must be one number per tensor, of one length; got shapes "
                         f"{V.shape}, {n.shape}{'' if signal is None else f', {np.shape(signal)}'}")
    _check_entries(V, "noise", "a finite number >= 0 (a variance)", lambda x: np.isfinite(x) & (x >= 0))
    _check_entries(n, "numel", "an integer >= 1 (a tensor's coordinates)", lambda x: np.isfinite(x) & (x >= 1)
                   & (x == np.round(x)))
    if signal is not None:
        _check_entries(_numbers(signal, "signal"), "signal", "a finite number", np.isfinite)
    live = V > 0
    w = np.zeros_like(V)
    if signal is None:
        w[live] = np.sqrt(n[live] * V[live])
    else:
        S = np.clip(np.asarray(signal, dtype=np.float64), 0.0, None)
        w[live] = S[live] * np.sqrt(n[live] / V[live])
    total = float(w.sum())
    return w / total if total > 0 else w


def _check_entries(values: np.ndarray, name: str, what: str, good) -> None:
    """Raise naming ``name[j]``, the first entry of ``values`` that ``good`` (elementwise) refuses, as ``what``."""
    bad = np.flatnonzero(~good(values))
    if bad.size:
        raise ValueError(f"{name}[{bad[0]}] must be {what}; got {values[bad[0]]!r} ({bad.size} such of {values.size})")


def adam_tensor_factor(error_to_noise: Sequence[float], weights: Sequence[float]) -> float:
    """``sum_t w_t / sqrt(1 + E_t / V_t)``: Adam's progress per update against exact's for an unbiased estimator whose
    error ``E_t`` sits in each tensor ``t`` in its own proportion to that tensor's noise ``V_t`` (``error_to_noise``
    ``[T]``; NaN where a tensor has no noise), with the tensors weighted by :func:`tensor_weights`. With the same
    ratio in every tensor it is the global model's ``1 / sqrt(1 + E|e|^2 / V_b)``. ``weights``: finite, >= 0, summing
    to 1; ``error_to_noise``: finite and >= 0 wherever the weight is > 0 (NaN only where it is 0)."""
    r, w = _numbers(error_to_noise, "error_to_noise"), _numbers(weights, "weights")
    if r.shape != w.shape:
        raise ValueError(f"error_to_noise and weights must be one number per tensor, of one length; got shapes "
                         f"{r.shape} and {w.shape}")
    _check_entries(w, "weights", "a finite number >= 0", lambda x: np.isfinite(x) & (x >= 0))
    if not abs(w.sum() - 1.0) <= 1e-6:
        raise ValueError(f"weights must sum to 1 (tensor_weights' shares); they sum to {w.sum():.6g}")
    _check_entries(r, "error_to_noise", "a finite number >= 0 where its weight is > 0",
                   lambda x: (w == 0) | (np.isfinite(x) & (x >= 0)))
    return _adam_tensor_factor(r, w)


def _adam_tensor_factor(r: np.ndarray, w: np.ndarray) -> float:
    """:func:`adam_tensor_factor` unchecked, for the meter's own estimates: NaN when no tensor has a weight."""
    use = w > 0
    if not use.any() or np.isnan(r[use]).any():
        return math.nan
    return float((w[use] / np.sqrt(1.0 + np.clip(r[use], 0.0, None))).sum())


def _error_noise(exact: Tensor, mean_err: Tensor, err_sq: Tensor) -> dict:
    n = exact.shape[0]
    noise = float(((exact - exact.mean(0)) ** 2).sum(1).sum()) / (n - 1)          # V_b: trace of the covariance
    s = exact.sum(0)
    signal = (float(s @ s) - float((exact * exact).sum())) / (n * (n - 1))        # |E g|^2, unbiased (U-statistic)
    s = mean_err.sum(0)
    bias = (float(s @ s) - float((mean_err * mean_err).sum())) / (n * (n - 1))   # |E e|^2, unbiased
    err = float(err_sq.mean())
    return {"noise": noise, "signal_sq": signal, "bias_sq": bias, "error_sq": err,
            "error_to_noise": err / noise if noise > 0 else math.nan,
            "bias_to_noise": bias / noise if noise > 0 else math.nan,
            "signal_to_noise": signal / noise if noise > 0 else math.nan}


def _tensor_stats(exact: Tensor, errs: list[Tensor], mean_err: Tensor, sizes: Sequence[int],
                  signal_measured: bool) -> dict:
    """Per parameter tensor (``sizes``: their numbers of coordinates, in the flat order), the terms of
    :func:`_error_noise` and Adam's per-tensor model (:func:`tensor_weights`, :func:`adam_tensor_factor`)."""
    if sum(sizes) != exact.shape[1]:
        raise ValueError(f"the tensor sizes sum to {sum(sizes)}, not to the gradient's {exact.shape[1]} coordinates")
    tensors, start = [], 0
    for size in sizes:
        cut = slice(start, start + size)
        start += size
        err_sq = torch.tensor([float((e[:, cut] ** 2).sum(1).mean()) for e in errs], dtype=torch.float64)
        tensors.append({"numel": int(size), **_error_noise(exact[:, cut], mean_err[:, cut], err_sq)})
    noise = [t["noise"] for t in tensors]
    weights = tensor_weights(noise, sizes, [t["signal_sq"] for t in tensors] if signal_measured else None)
    for t, w in zip(tensors, weights):
        t["weight"] = float(w)
    return {"tensors": tensors, "tensor_weighting": "signal" if signal_measured else "noise",
            "adam_tensor_factor": _adam_tensor_factor(np.array([t["error_to_noise"] for t in tensors]), weights)}


def _check_gradients(exact: Tensor, estimates: Sequence[Tensor]) -> None:
    """:func:`error_noise_stats`' arguments: ``exact`` ``[n >= 3, P]`` and ``n`` estimates ``[draws >= 1, P]``, all
    finite (one check a tensor); an error names the argument."""
    check_tensor(exact, "exact", "[n, P] (one exact gradient per batch)")
    check_finite_tensor(exact, "exact", "each batch's exact gradient")
    if isinstance(estimates, Tensor) or not hasattr(estimates, "__len__"):
        raise TypeError(f"estimates must be a sequence of n tensors [draws, P], one per batch; got "
                        f"{type(estimates).__name__}")
    if exact.ndim != 2 or exact.shape[0] < 3 or len(estimates) != exact.shape[0]:
        raise ValueError(f"need exact [n, P] with n >= 3 batches and one [draws, P] estimate tensor per batch; got "
                         f"exact {tuple(exact.shape)} and {len(estimates)} estimates")
    for i, e in enumerate(estimates):
        if not isinstance(e, Tensor) or e.ndim != 2 or e.shape[0] < 1 or e.shape[1] != exact.shape[1]:
            raise ValueError(f"estimates[{i}] must be a tensor [draws >= 1, P = {exact.shape[1]}]; got "
                             f"{tuple(e.shape) if isinstance(e, Tensor) else type(e).__name__}")
        check_finite_tensor(e, f"estimates[{i}]", "the estimator's gradients of batch i")


def error_noise_stats(exact: Tensor, estimates: Sequence[Tensor], sizes: Sequence[int] | None = None) -> dict:
    """An estimator's error against the batch-to-batch noise of the exact gradient, from ``n >= 3`` batches.

    Args:
        exact: ``[n, P]`` the exact gradient of each batch.
        estimates: ``n`` tensors ``[d_i, P]``: ``d_i >= 1`` draws of the estimator on batch ``i``.
        sizes: the number of coordinates of each parameter tensor, in the order of the ``P`` coordinates (summing to
            ``P``), for Adam's per-tensor model; None: the whole vector is one tensor.

    Returns (float64 arithmetic; ``_se``: jackknife standard errors over the batches):
        ``noise`` ``V_b`` (trace of the exact gradients' covariance across batches), ``error_sq`` ``E|e|^2`` (mean
        squared error against the same batch's exact gradient), ``bias_sq`` (``mean_{i != j} <e_i, e_j>`` of the
        batches' mean errors: the squared norm of the error that repeats across batches, unbiased, may be < 0 by
        chance), ``signal_sq`` (the same for the exact gradients: ``|E g|^2``), their ratios to the noise
        ``error_to_noise``, ``bias_to_noise``, ``signal_to_noise`` (each with ``_se``), ``grad_norm`` (mean
        ``|g|``), ``rel_err`` (``sqrt(E|e|^2) / grad_norm``), ``same_batch_cosine`` (mean cosine to exact),
        ``bias_to_signal`` (``|b|^2 / |E g|^2``: a bias is harmless only when this is small) and ``bias_signal_cos``
        (``<b, E g> / (|b| |E g|)`` from ``mean_{i != j} <e_i, g_j>``; NaN unless both squared norms are > 0); and
        Adam's per-tensor model: ``tensors`` (per tensor ``numel``, ``noise``, ``error_sq``, ``bias_sq``,
        ``signal_sq``, their ratios and its ``weight``), ``tensor_weighting`` (``signal`` when ``signal_to_noise`` is
        :data:`SIGNAL_Z` standard errors above 0, else ``noise``) and ``adam_tensor_factor``
        (:func:`adam_tensor_factor`).
    """
    _check_gradients(exact, estimates)
    n = exact.shape[0]
    exact = exact.double()
    errs = [e.double() - g for e, g in zip(estimates, exact)]                     # [d_i, P] each
    mean_err = torch.stack([e.mean(0) for e in errs])                              # [n, P]
    err_sq = torch.tensor([float((e * e).sum(1).mean()) for e in errs], dtype=torch.float64)
    out = _error_noise(exact, mean_err, err_sq)
    # the repeating error against the signal: mean_{i != j} <e_i, g_j>, and its cosine (NaN unless both are > 0)
    cross = (float(mean_err.sum(0) @ exact.sum(0)) - float((mean_err * exact).sum())) / (n * (n - 1))
    both = out["bias_sq"] > 0 and out["signal_sq"] > 0
    out["bias_to_signal"] = out["bias_sq"] / out["signal_sq"] if out["signal_sq"] > 0 else math.nan
    out["bias_signal_cos"] = cross / math.sqrt(out["bias_sq"] * out["signal_sq"]) if both else math.nan
    loo = [_error_noise(exact[keep], mean_err[keep], err_sq[keep])
           for keep in ([j for j in range(n) if j != i] for i in range(n))]
    for key in ("error_to_noise", "bias_to_noise", "signal_to_noise"):
        out[f"{key}_se"] = _jackknife_se(np.array([r[key] for r in loo], dtype=np.float64))
    norms = exact.norm(dim=1)
    out["grad_norm"] = float(norms.mean())
    out["rel_err"] = math.sqrt(max(out["error_sq"], 0.0)) / out["grad_norm"] if out["grad_norm"] > 0 else math.nan
    cos = [float(torch.nn.functional.cosine_similarity(e.double(), g[None], dim=1).mean())
           for e, g in zip(estimates, exact)]
    out["same_batch_cosine"] = statistics.fmean(cos)
    se = out["signal_to_noise_se"]
    measured = se > 0 and out["signal_to_noise"] > SIGNAL_Z * se
    out.update(_tensor_stats(exact, errs, mean_err, list(sizes) if sizes is not None else [exact.shape[1]], measured))
    return out


def jackknife_se(leave_one_out: Sequence[float]) -> float:
    """The jackknife standard error of a statistic from its ``n`` leave-one-out values:
    ``sqrt((n - 1) / n sum_i (x_i - mean)^2)``."""
    vals = _numbers(leave_one_out, "leave_one_out")
    if vals.size < 2:
        raise ValueError(f"leave_one_out must be n >= 2 leave-one-out values; got shape {vals.shape}")
    _check_entries(vals, "leave_one_out", "a finite number", np.isfinite)
    return _jackknife_se(vals)


def _jackknife_se(vals: np.ndarray) -> float:
    """:func:`jackknife_se` unchecked, for the meter's own estimates (NaN in, NaN out)."""
    n = vals.size
    return math.sqrt((n - 1) / n * float(((vals - vals.mean()) ** 2).sum()))


def extrapolate(stats: dict, batch: float, target: float) -> dict:
    """:func:`error_noise_stats`' ratios at ``target`` samples per update instead of the measured ``batch``: the
    noise and the unbiased part of the error fall as ``1 / B``, the bias (``bias_sq``, floored at 0) stays; per tensor
    alike, for ``adam_tensor_factor`` (the weights do not change with the batch)."""
    check_positive(batch, "batch", "samples per update measured")
    check_positive(target, "target", "samples per update to extrapolate to")
    check_fields(stats, {"noise": "number", "bias_sq": "number", "error_sq": "number"}, "stats (of error_noise_stats)")
    for i, st in enumerate([stats, *stats.get("tensors", [])]):
        where = "stats" if i == 0 else f"stats['tensors'][{i - 1}]"
        for key, low in (("noise", 0.0), ("error_sq", 0.0), ("bias_sq", None), *((("weight", 0.0),) if i else ())):
            check_number(st.get(key) if isinstance(st, dict) else None, f"{where}[{key!r}]", low)
    scale = batch / target

    def ratios(st: dict) -> tuple[float, float]:
        noise = st["noise"] * scale
        bias = max(st["bias_sq"], 0.0)
        err = bias + max(st["error_sq"] - bias, 0.0) * scale
        return (err / noise, st["bias_sq"] / noise) if noise > 0 else (math.nan, math.nan)

    e2n, b2n = ratios(stats)
    out = {"error_to_noise": e2n, "bias_to_noise": b2n}
    if "tensors" in stats:
        out["adam_tensor_factor"] = _adam_tensor_factor(np.array([ratios(t)[0] for t in stats["tensors"]]),
                                                        np.array([t["weight"] for t in stats["tensors"]], float))
    return out



class Meter:
    """The training-time meter: running estimates, over the audits of one run, of the configured
    estimator's error against the noise of one update, from the audit's per-prompt-group gradients.

    Each audit gives ``m >= 2`` prompt groups' exact gradients ``g_j`` and errors ``e_j`` (estimate - exact, each a
    mean over its prompt group). Then, with ``G`` prompt groups per optimizer update:

    - noise of one update: ``V_b = var_j(g_j) / G`` (the prompt groups' spread, averaged over audits), and per
      parameter tensor ``V_t`` the same over its coordinates;
    - bias: ``|b|^2 = mean_{j != j'} <e_j, e_j'>`` over every pair of prompt groups in every audit kept (count sketches of
      ``sketch_dim`` buckets stand in for the full vectors, so memory does not grow with the model; unbiased), and
      ``bias_z``: ``|b|^2`` in jackknife standard errors over the audits;
    - error of one update: ``E|e|^2 = |b|^2 + (mean |e_j|^2 - |b|^2) / G``, shared out over the tensors as their
      ``mean |e_j,t|^2``;
    - ``predicted_efficiency = (rows_exact / rows) / (1 + E|e|^2 / V_b)``, and ``predicted_time_efficiency`` with the
      iteration-time ratio estimated from the share of the iteration the training phase takes
      (``(1 - f) + f rows_exact / rows``);
    - ``predicted_adam_efficiency`` and ``predicted_adam_time_efficiency``: the same with :func:`adam_efficiency`, the
      model for the trainers' AdamW (for an unbiased estimator; read ``bias_z`` first), and
      ``predicted_adam_tensor_efficiency``, ``predicted_adam_tensor_time_efficiency``: the work ratios times
      :func:`adam_tensor_factor`, each tensor weighted by its noise (:func:`tensor_weights` without a signal: a few
      audited prompt groups do not measure one).

    Args:
        sizes: the number of coordinates of each parameter tensor, in the order of the gradients' ``P`` coordinates
            (None: one tensor).
        sketch_dim, keep, seed: the count sketches' buckets, how many prompt groups' sketches are kept (the newest),
            and the seed of their hashing.
    """

    def __init__(self, sizes: Sequence[int] | None = None, sketch_dim: int = 4096, keep: int = 256, seed: int = 0):
        if sizes is not None:
            _check_entries(_numbers(sizes, "sizes"), "sizes", "an integer >= 1 (a tensor's coordinates)",
                           lambda x: np.isfinite(x) & (x >= 1) & (x == np.round(x)))
        sketch_dim, keep, seed = check_count(sketch_dim, "sketch_dim"), check_count(keep, "keep"), check_count(seed,
                                                                                                          "seed", 0)
        self.sizes = None if sizes is None else [int(n) for n in sizes]
        self.k, self.keep, self.seed = sketch_dim, keep, seed
        self.index = self.sign = None
        self.sketches: list[tuple[int, Tensor]] = []          # (audit number, sketch of e_j)
        self.noise: list[float] = []                          # per audit: var_j(g_j)
        self.err_sq: list[float] = []                         # per prompt group: |e_j|^2
        self.tensor_noise: list[list[float]] = []             # per audit: var_j(g_j,t) per tensor
        self.tensor_err_sq: list[list[float]] = []            # per prompt group: |e_j,t|^2 per tensor
        self.rows = [0, 0]                                     # exact, estimator (an older state may hold a third)
        self.audits = 0

    STATE = ("sizes", "k", "keep", "seed", "sketches", "noise", "err_sq", "tensor_noise", "tensor_err_sq", "rows",
             "audits")
    STATE_FIELDS = {"sizes": "list|null", "k": "integer", "keep": "integer", "seed": "integer", "sketches": "list",
                    "noise": "list", "err_sq": "list", "tensor_noise": "list", "tensor_err_sq": "list", "rows": "list",
                    "audits": "integer"}                # what :meth:`state_dict` holds, by kind

    def state_dict(self) -> dict:
        """Everything the meter has measured (for a checkpoint: :meth:`from_state` continues from it exactly)."""
        return {key: copy.deepcopy(getattr(self, key)) for key in self.STATE}

    @classmethod
    def from_state(cls, state: dict) -> "Meter":
        """The meter of a :meth:`state_dict` (checked to hold :data:`STATE_FIELDS`, else a ValueError naming the key)."""
        check_fields(state, cls.STATE_FIELDS, "the meter's state")
        meter = cls()
        for key in cls.STATE:
            setattr(meter, key, copy.deepcopy(state[key]))
        return meter

    def _sketch(self, v: Tensor) -> Tensor:
        if self.index is None:
            g = torch.Generator().manual_seed(self.seed)
            self.index = torch.randint(0, self.k, (v.numel(),), generator=g)
            self.sign = torch.randint(0, 2, (v.numel(),), generator=g).double() * 2 - 1
        return torch.zeros(self.k, dtype=torch.float64).index_add_(0, self.index, v.double().cpu() * self.sign)

    def _bias(self, skip: int | None = None) -> float:
        items = [s for a, s in self.sketches if a != skip]
        if len(items) < 2:
            return math.nan
        S = torch.stack(items)
        tot = S.sum(0)
        n = len(items)
        return (float(tot @ tot) - float((S * S).sum())) / (n * (n - 1))

    def _per_tensor(self, v: Tensor) -> list[list[float]]:
        """``v`` ``[m, P]`` -> per tensor, its rows' squared norms there (``T`` lists of ``m``)."""
        sizes = self.sizes or [v.shape[1]]
        return [[float(x) for x in (part ** 2).sum(1)] for part in v.split(sizes, dim=1)]

    def update(self, exact: Tensor, estimate: Tensor, rows_exact: int, rows_estimator: int, prompt_groups_per_update: float,
               train_share: float | None = None) -> dict:
        """Add one audit (``exact``, ``estimate``: ``[m, P]`` per-prompt-group gradients) and return the running estimates:
        ``error_to_noise``, ``bias_to_noise`` (with ``bias_to_noise_se``, jackknife over audits, and ``bias_z``),
        ``rows_ratio`` (exact's rows over the estimator's), ``predicted_efficiency``, ``predicted_time_efficiency``
        (NaN when ``train_share`` is None), the same two for Adam (``predicted_adam_efficiency``,
        ``predicted_adam_time_efficiency``) and for Adam per tensor (``predicted_adam_tensor_efficiency``,
        ``predicted_adam_tensor_time_efficiency``) and ``audits``."""
        self._check_audit(exact, estimate, rows_exact, rows_estimator, prompt_groups_per_update, train_share)
        self.audits += 1
        self.rows[0] += rows_exact
        self.rows[1] += rows_estimator
        self._record(exact, estimate)
        out = {"audits": self.audits, **dict.fromkeys(self.KEYS, math.nan)}
        if not self.noise:
            return out
        G = max(prompt_groups_per_update, 1.0)
        noise, err, mean_sq = self._noise_and_error(out, G)
        tensor_sq = np.mean(self.tensor_err_sq, 0)                                      # [T]: mean |e_j,t|^2
        tensor_err = err * tensor_sq / mean_sq if mean_sq > 0 else np.zeros_like(tensor_sq)
        self._predict(out, noise, err, self.rows[1], np.mean(self.tensor_noise, 0) / G, tensor_err, train_share,
                      exact.shape[1])
        return out

    def _check_audit(self, exact, estimate, rows_exact, rows_estimator, prompt_groups_per_update, train_share):
        """:meth:`update`'s arguments, checked before the meter changes: ``exact`` and ``estimate`` tensors of one shape
        ``[m, P]`` (``P`` the sum of ``sizes``), row counts >= 0, ``prompt_groups_per_update`` > 0 and ``train_share``
        None or in [0, 1]."""
        check_tensor(exact, "exact", "[m, P] (each prompt group's exact gradient)")
        check_tensor(estimate, "estimate", "[m, P] (each prompt group's estimated gradient)")
        P = sum(self.sizes) if self.sizes else exact.shape[-1]
        if exact.ndim != 2 or estimate.shape != exact.shape or exact.shape[1] != P:
            raise ValueError(f"exact and estimate must both be [m, P = {P}]; got {tuple(exact.shape)} and "
                             f"{tuple(estimate.shape)}")
        check_finite_tensor(exact, "exact", "each prompt group's exact gradient")
        check_finite_tensor(estimate, "estimate", "each prompt group's estimated gradient")
        check_count(rows_exact, "rows_exact", 0)
        check_count(rows_estimator, "rows_estimator", 0)
        check_positive(prompt_groups_per_update, "prompt_groups_per_update")
        if train_share is not None and (not is_finite_number(train_share) or not 0 <= train_share <= 1):
            raise ValueError(f"train_share must be None or a number in [0, 1]; got {train_share!r}")

    KEYS = ("error_to_noise", "bias_to_noise", "bias_to_noise_se", "bias_z", "rows_ratio", "predicted_efficiency",
            "predicted_time_efficiency", "predicted_adam_efficiency", "predicted_adam_time_efficiency",
            "predicted_adam_tensor_efficiency", "predicted_adam_tensor_time_efficiency")

    def _record(self, exact: Tensor, estimate: Tensor) -> None:
        """Keep one audit's noise (``var_j(g_j)``, per tensor too) and its prompt groups' errors (squared norms, per
        tensor, and sketches); nothing with fewer than two prompt groups."""
        m = exact.shape[0]
        if m < 2:
            return
        ex = exact.double()
        err = estimate.double() - ex
        self.noise.append(float(((ex - ex.mean(0)) ** 2).sum()) / (m - 1))
        self.tensor_noise.append([float(x) / (m - 1) for x in np.sum(self._per_tensor(ex - ex.mean(0)), 1)])
        for e, per in zip(err, np.transpose(self._per_tensor(err))):
            self.err_sq.append(float(e @ e))
            self.tensor_err_sq.append([float(x) for x in per])
            self.sketches.append((self.audits, self._sketch(e)))
        self.sketches = self.sketches[-self.keep:]

    def _noise_and_error(self, out: dict, G: float) -> tuple[float, float, float]:
        """``(V_b, E|e|^2, mean |e_j|^2)`` of one update of ``G`` prompt groups; sets ``out``'s bias terms."""
        noise = statistics.fmean(self.noise) / G
        bias = self._bias()
        b0 = 0.0 if math.isnan(bias) else max(bias, 0.0)
        mean_sq = statistics.fmean(self.err_sq)
        out["bias_to_noise"] = bias / noise if noise > 0 else math.nan
        audits = sorted({a for a, _ in self.sketches})
        if len(audits) >= 3 and noise > 0:
            out["bias_to_noise_se"] = se = _jackknife_se(np.array([self._bias(skip=a) / noise for a in audits]))
            out["bias_z"] = out["bias_to_noise"] / se if se > 0 else math.nan
        return noise, b0 + max(mean_sq - b0, 0.0) / G, mean_sq

    def _predict(self, out: dict, noise: float, err: float, rows: float, tensor_noise, tensor_err,
                 train_share: float | None, coordinates: int) -> None:
        """The efficiency predictions into ``out`` (:meth:`update`)."""
        rows_exact = self.rows[0]
        rho = rows_exact / max(rows, 1)
        out["rows_ratio"] = rho
        out["error_to_noise"] = err / noise if noise > 0 else math.nan
        with np.errstate(divide="ignore", invalid="ignore"):
            tensor_ratio = np.where(tensor_noise > 0, tensor_err / tensor_noise, np.nan)
        factor = _adam_tensor_factor(tensor_ratio, tensor_weights(tensor_noise, self.sizes or [coordinates]))
        out["predicted_efficiency"] = _rate(rho, out["error_to_noise"], 1.0)
        out["predicted_adam_efficiency"] = _rate(rho, out["error_to_noise"], 0.5)
        out["predicted_adam_tensor_efficiency"] = rho * factor
        if train_share is not None:
            time_ratio = ((1 - train_share) * rows + train_share * rows_exact) / (
                (1 - train_share) * rows + train_share * rows)
            out["predicted_time_efficiency"] = _rate(time_ratio, out["error_to_noise"], 1.0)
            out["predicted_adam_time_efficiency"] = _rate(time_ratio, out["error_to_noise"], 0.5)
            out["predicted_adam_tensor_time_efficiency"] = time_ratio * factor


def meter_flag(result: dict, min_audits: int = 4) -> str | None:
    """A warning when, after ``min_audits`` audits, the estimator's error repeats from batch to batch (its
    ``bias_to_noise`` more than 3 standard errors above 0), else None. There is no warning on the predicted
    efficiencies: they model an unbiased estimator, so a repeating error is outside what they can see (what a repeating
    error costs in the measured runs: docs/results.md)."""
    if not isinstance(result, dict):
        raise TypeError(f"result must be the dict of Meter.update; got {type(result).__name__}")
    check_count(min_audits, "min_audits", 0)
    if result.get("audits", 0) < min_audits:
        return None
    b, se = result.get("bias_to_noise", math.nan), result.get("bias_to_noise_se", math.nan)
    if not (math.isnan(b) or math.isnan(se)) and b > 3 * se and b > 0:
        return (f"audit: this estimator's error repeats from batch to batch (bias^2 / noise {b:.4f} +- {se:.4f}): a "
                "bias Adam integrates like a signal; "
                "consider estimator.correction_p > 0 (unbiased JAGG), keeping the intervals where it lives exact "
                "(jagg bench meter --by-interval), or estimator.mode=exact")
    return None
