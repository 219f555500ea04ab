"""Typed configuration of the gradient estimator (one dataclass per concern, validated on creation)."""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from .checks import check_probabilities, first_non_finite, parse_spec

MODES = ("exact", "jagg", "subsample")
AUTO = "auto"                     # mode auto: the trainers choose among MODES at a run's start (jagg.trainers.auto)
INTERMEDIATES = ("interp", "fresh", "stale")    # what an update runs; also "auto" (interp on-policy, else fresh)
INTERMEDIATE_CHOICES = (*INTERMEDIATES, AUTO_INTERMEDIATE := "auto")
KNOTS = ("groups", "shared")
INNER_CLIPS = ("step", "none", "group")         # how PPO's clip treats a JAGG interval's inner terms
ALPHAS = ("sigma", "index")
NUMBERS = ("jagg_frac", "clip_range", "kl_beta", "subsample_frac", "interval_frac")  # finite, first
# mode auto's default candidates, from the paired seeds (docs/benchmarks.md "estimator.mode: auto"): the paper's
# step groups and shared knots plain, and the two unbiased layouts that paid at an equal budget on the 20-step JPEG job
DEFAULT_CANDIDATES = ("g4:knots=groups,window=4,correction_p=0", "s4:knots=shared,window=4,correction_p=0",
                      "g4u:knots=groups,window=4,correction_p=0.25", "s5u:knots=shared,window=5,correction_p=0.1")
# what a candidate may not set: the mode auto chooses, the loss every candidate shares, and the measurement's own keys
NOT_CANDIDATE_KEYS = ("candidates", "clip_range", "kl_beta", "meter_every", "meter_samples", "preflight_batches",
                      "preflight_draws", "preflight_margin", "preflight_share")


@dataclass
class EstimatorConfig:
    """How the policy gradient of one Flow-GRPO update is computed (docs/design.md §2-3; its words: §0)."""

    mode: str = field(default="jagg", metadata={"help": f"Gradient estimator, one of {(*MODES, AUTO)}. 'exact' runs "
                      "one backward per trained step (the Flow-GRPO baseline); 'jagg' one joint backward of the two "
                      "knots of each interval; "
                      "'subsample' trains a fresh random subset of each sample's steps, scaled up (DanceGRPO's "
                      "timestep_fraction: the baseline JAGG must beat at equal rows); 'auto' (trainers only): the "
                      "run's first preflight_batches iterations train exact and measure the candidates beside each "
                      "update on the same minibatches (the meter's verdict), then train with the one it recommends, "
                      "exact unless a candidate's projected progress per second clears exact's by preflight_margin at "
                      "every update position of a rollout."})
    window: int = field(default=4, metadata={"help": "W: the trained steps of one interval, its two knots included "
                        "(knots='groups': disjoint step groups of W; 'shared': consecutive intervals share their end "
                        "knot, a knot every W-1 steps). 1 (or 2) gives the exact gradient."})
    knots: str = field(default="groups", metadata={"help": f"Where the rows with grad (knots) sit, one of {KNOTS}: "
                       "'groups' = the paper's step groups of W steps, 2 knot rows each; 'shared' = consecutive "
                       "intervals share a knot, knots every W-1 steps (1 + ceil((K-1)/(W-1)) rows per sample instead of "
                       "2 ceil(K/W))."})
    alpha: str = field(default="sigma", metadata={"help": f"Interpolation coefficient of an inner step, one of "
                       f"{ALPHAS}: 'sigma' = (sigma_k - sigma_a) / (sigma_b - sigma_a) (the paper's t-weighting); "
                       "'index' = (k - a) / (b - a) (the authors' reference code)."})
    intermediate: str = field(default="auto", metadata={"help": f"Velocities at an interval's inner steps, one of "
                              f"{INTERMEDIATE_CHOICES}: 'fresh' = a no-grad forward each (the paper); 'interp' = no "
                              "forward, first-order reuse of the rollout velocities, exact only on-policy (the first "
                              "update after sampling): after an optimizer step its error enters the inner steps' "
                              "ratios and clip decisions; 'stale' = no forward, the rollout velocities themselves "
                              "(ratio 1, never clipped, at the inner steps; exact on-policy; off-policy PPO's clipping "
                              "then acts at the knots only); 'auto' = 'interp' in an on-policy update, 'fresh' in an "
                              "off-policy one (policy_gradient(..., on_policy=True/False); the trainers pass it; "
                              "unknown counts as off-policy)."})
    inner_clip: str = field(default="step", metadata={"help": f"How PPO's clip treats the inner terms of a JAGG "
                            f"interval, one of {INNER_CLIPS} (the knots' own terms are always clipped per step, as "
                            "exact clips them; ratios and KL stay exact at every step). 'step' = per term, as exact "
                            "(the default). Off-policy a clipped inner term drops its sample's share of the "
                            "interpolation error a prompt group's samples share, which then no longer cancels in "
                            "their zero-sum advantages (docs/results.md); 'none' = inner terms unclipped; "
                            "'group' = one decision per prompt group (policy_gradient's prompt_groups; without them "
                            "each sample is its own group, which is 'step') and inner step: every member's term is "
                            "dropped when the group's advantage-weighted ratio 1 + sum A (r - 1) / sum |A| exceeds "
                            "1 + clip_range, else all are kept unclipped (PPO's own rule for one sample). 'group' "
                            "decides from the inner velocities before any backward: 'fresh' ones (their no-grad "
                            "forwards run first), 'stale' ones (ratio 1, kept); with 'interp' (intermediate 'auto' "
                            "on-policy, where every ratio is 1) it keeps them all, as 'none'."})
    jagg_frac: float = field(default=1.0, metadata={"help": "Fraction in [0, 1] of the units (prompt group, or "
                             "sample, x interval) routed through JAGG, the most linear first (mean cosine of "
                             "consecutive velocity increments with the interval's chord, from the stored velocities); "
                             "the rest run exact. 0 = exact. Only intervals of >= 3 steps count (JAGG is exact and no "
                             "cheaper on 1- or 2-step intervals)."})
    exact_first_intervals: int = field(default=0, metadata={"help": "Always run the first N intervals with inner "
                                       "steps (the noisiest) exact. Where JAGG's error lives (often not there): jagg "
                                       "bench meter --by-interval."})
    exact_last_intervals: int = field(default=0, metadata={"help": "Always run the last N intervals with inner steps "
                                      "(the cleanest) exact."})
    correction_p: float = field(default=0.0, metadata={"help": "Unbiased JAGG: probability in [0, 1] that a "
                                      "JAGG unit (prompt group with prompt_groups, else sample, x interval) also runs "
                                      "its inner steps exactly and adds (exact - interpolated) / p, so the expected "
                                      "gradient is exact. Costs p x the inner rows and adds variance (1/p - 1)|e|^2. 0 "
                                      "(the default) = plain JAGG (the paper), biased where the Jacobian is not linear. "
                                      "It pays where JAGG's error repeats and the updates are on-policy; off-policy "
                                      "(several updates per iteration, the main job) it multiplies JAGG's heavy-tailed "
                                      "error by 1/p (docs/results.md). Choose p with jagg bench meter, a few fixed "
                                      "probabilities side by side."})
    correction_probs: list[float] | None = field(default=None, metadata={"help":
                                                 "Per-interval correction probabilities p_j in [0, 1], one per interval of the layout in order "
                                                 "(e.g. [0.4, 0.1] for two step groups), used instead of correction_p; "
                                                 "the probability of an interval that runs exact is unused. "
                                                 "jagg.knots.budget_probs sets p_j proportional to sqrt(D_j / r_j) at a "
                                                 "row budget from each interval's error D_j (jagg bench meter "
                                                 "--by-interval) and inner rows r_j. null = correction_p everywhere."})
    interval_frac: float = field(default=1.0, metadata={"help": "Interval subsampling (the JAGG authors' "
                                 "timestep_fraction of step groups): each sample trains a fresh random round(f n) (at "
                                 "least 1, the same ones for a prompt group's samples with prompt_groups) of the n intervals of the layout of window and knots, each drawn interval's "
                                 "loss terms weighted n / that number, so the expected gradient is the estimator's over "
                                 "all intervals. Composes with routing, exact_first/last_intervals and the correction (a "
                                 "drawn interval is corrected with its usual probability; an undrawn one is neither "
                                 "routed nor corrected). In mode='exact' it draws the same intervals (window > 2): "
                                 "subsampling of whole step ranges, the authors' exact baseline. 1 = every interval, "
                                 "bit for bit. Not with mode='subsample'."})
    subsample_frac: float = field(default=0.5, metadata={"help": "mode='subsample': each sample trains a fresh random "
                                  "round(f K) (at least 1) of its K trained steps, each weighted K / that number, so "
                                  "the expected gradient is exact; 1 = exact bit for bit. Ignored by the other modes."})
    micro_batch: int = field(default=8, metadata={"help": "Rows per network forward/backward, the same in every "
                             "mode. JAGG needs >= 2 (an interval's two knots go through together)."})
    clip_range: float = field(default=1e-4, metadata={"help": "PPO clip range eps of the ratio (Flow-GRPO: 1e-4)."})
    kl_beta: float = field(default=0.0, metadata={"help": "Weight of the KL to the reference policy (Flow-GRPO "
                           "uses 0.04 on GenEval); > 0 needs reference velocities."})
    meter_every: int = field(default=0, metadata={"help": "Trainers only: every N iterations, "
                             "compute the exact "
                             "gradient of a few samples next to this estimator's and log their cosine, in total and per "
                             "third of the trained steps, both clip fractions, and the meter's running "
                             "estimates (audit/* in metrics and TensorBoard). The j-th "
                             "audit runs before update j mod U of its iteration (U = inner_epochs x updates_per_epoch), "
                             "so the off-policy updates are audited too. With mode 'auto': the chosen candidate is "
                             "re-measured beside exact instead, and dropped for exact when it no longer clears the bar. "
                             "0 = off."})
    meter_samples: int = field(default=4, metadata={"help": "Trainers only: samples (whole "
                               "prompt groups, at least "
                               "two) the audit uses."})
    candidates: list[str] = field(default_factory=lambda: list(DEFAULT_CANDIDATES), metadata={"help": "mode='auto': "
                                  "the estimators measured beside exact (always measured, and chosen "
                                  "unless a candidate wins), each 'NAME:KEY=VALUE,...' of estimator keys on top of this "
                                  "section's in mode 'jagg' (e.g. 's5u:knots=shared,window=5,correction_p=0.1'; "
                                  "'mode=subsample' for subsampling); 'exact' may be listed. Every name once. Defaults: "
                                  "plain step groups and shared knots of 4, unbiased step groups of 4 (p 0.25) and "
                                  "unbiased shared knots of 5 (p 0.1)."})
    preflight_batches: int = field(default=6, metadata={"help": "mode='auto': the iterations (>= 3) whose updates are "
                                   "measured, every candidate beside exact's update at each update position of a "
                                   "rollout (jagg bench meter --batches)."})
    preflight_draws: int = field(default=1, metadata={"help": "mode='auto': draws per update of a random candidate "
                                 "(unbiased JAGG, subsampling) in the measurement (jagg bench meter --draws)."})
    preflight_margin: float = field(default=0.1, metadata={"help": "mode='auto': a candidate is chosen only when the low "
                                    "end of its projected progress per second (the meter's per-update rate range times "
                                    "the measured iteration ratio) is at least 1 + this times exact's at every update "
                                    "position; else the run trains exact."})
    preflight_share: float = field(default=0.2, metadata={"help": "mode='auto': the measurement's budget, a share of the "
                                   "run's projected CPU time (grpo.iterations exact iterations, timed by the first "
                                   "measured one); after that iteration the measurement also stops, and the run trains "
                                   "exact, when its rest costs more than a candidate clearing the margin could win back "
                                   "in the remaining iterations."})

    def __post_init__(self):
        for f in fields(self):                        # numpy scalars (np.int64(4), np.float32(0.5)) as Python numbers
            if isinstance(getattr(self, f.name), np.generic):
                setattr(self, f.name, getattr(self, f.name).item())
        if self.mode not in (*MODES, AUTO):
            raise ValueError(f"mode must be one of {(*MODES, AUTO)}; got {self.mode!r}")
        bad = first_non_finite({name: getattr(self, name) for name in NUMBERS})
        if bad is not None:
            raise ValueError(f"{bad} must be a finite number; got {getattr(self, bad)!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an integer >= 1 (the trained steps of an interval); got {self.window!r}")
        if self.intermediate not in INTERMEDIATE_CHOICES:
            raise ValueError(f"intermediate must be one of {INTERMEDIATE_CHOICES}; got {self.intermediate!r}")
        if not 0.0 <= float(self.jagg_frac) <= 1.0:
            raise ValueError(f"jagg_frac must be in [0, 1] (0 = exact everywhere, 1 = JAGG everywhere); "
                             f"got {self.jagg_frac}")
        if self.inner_clip not in INNER_CLIPS:
            raise ValueError(f"inner_clip must be one of {INNER_CLIPS}; got {self.inner_clip!r}")
        if self.knots not in KNOTS:
            raise ValueError(f"knots must be one of {KNOTS}; got {self.knots!r}")
        if self.alpha not in ALPHAS:
            raise ValueError(f"alpha must be one of {ALPHAS}; got {self.alpha!r}")
        if not 0.0 < float(self.subsample_frac) <= 1.0:
            raise ValueError(f"subsample_frac must be in (0, 1] (the fraction of trained steps each sample trains in "
                             f"mode='subsample'); got {self.subsample_frac}")
        if first_non_finite({"correction_p": self.correction_p}) is not None or not 0.0 <= self.correction_p <= 1.0:
            raise ValueError(f"correction_p must be a finite number in [0, 1] (0 = plain JAGG); got "
                             f"{self.correction_p!r}")
        if self.correction_probs is not None:
            self.correction_probs = check_probabilities(self.correction_probs, "correction_probs")
        if not 0.0 < float(self.interval_frac) <= 1.0:
            raise ValueError(f"interval_frac must be in (0, 1] (the fraction of each sample's intervals it trains); "
                             f"got {self.interval_frac}")
        if self.mode == "subsample" and self.interval_frac < 1:
            raise ValueError("interval_frac < 1 needs mode 'exact' or 'jagg': mode 'subsample' draws single steps "
                             "itself (subsample_frac)")
        if not isinstance(self.meter_samples, int) or self.meter_samples < 2:
            raise ValueError(f"meter_samples must be an integer >= 2; got {self.meter_samples!r}")
        for name in ("exact_first_intervals", "exact_last_intervals", "meter_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an integer >= 0; got {getattr(self, name)!r}")
        if not isinstance(self.micro_batch, int) or self.micro_batch < 1:
            raise ValueError(f"micro_batch must be an integer >= 1; got {self.micro_batch!r}")
        if self.mode == "jagg" and self.window > 2 and self.micro_batch < 2:
            raise ValueError("micro_batch must be >= 2 in mode='jagg' with window > 2: the two knots of an "
                             "interval go through the network together; raise micro_batch or use mode='exact'")
        if self.clip_range <= 0:
            raise ValueError(f"clip_range must be > 0; got {self.clip_range}")
        if self.kl_beta < 0:
            raise ValueError(f"kl_beta must be >= 0; got {self.kl_beta}")
        self._check_preflight()
        if self.mode == AUTO:
            self.candidate_configs()                     # a bad candidate is refused here, by name

    def _check_preflight(self) -> None:
        """The measurement's keys (mode auto's), checked in every mode so that a saved config always loads."""
        if not isinstance(self.preflight_batches, int) or isinstance(self.preflight_batches, bool) \
                or self.preflight_batches < 3:
            raise ValueError(f"preflight_batches must be an integer >= 3 (a variance and a bias across batches); got "
                             f"{self.preflight_batches!r}")
        if not isinstance(self.preflight_draws, int) or isinstance(self.preflight_draws, bool) \
                or self.preflight_draws < 1:
            raise ValueError(f"preflight_draws must be an integer >= 1; got {self.preflight_draws!r}")
        bad = first_non_finite({"preflight_margin": self.preflight_margin, "preflight_share": self.preflight_share})
        if bad is not None or self.preflight_margin < 0 or self.preflight_share <= 0:
            raise ValueError(f"preflight_margin must be a finite number >= 0 and preflight_share one > 0; got "
                             f"{self.preflight_margin!r} and {self.preflight_share!r}")
        if not isinstance(self.candidates, (list, tuple)) or not all(isinstance(c, str) for c in self.candidates):
            raise ValueError(f"candidates must be a list of 'NAME:KEY=VALUE,...' strings, e.g. "
                             f"[{DEFAULT_CANDIDATES[0]!r}]; got {self.candidates!r}")
        self.candidates = list(self.candidates)

    @property
    def probs(self) -> list[float]:
        """The correction's probabilities: ``correction_probs``, or ``[correction_p]`` for every interval."""
        return list(self.correction_probs) if self.correction_probs is not None else [float(self.correction_p)]

    @property
    def corrects(self) -> bool:
        """Whether unbiased JAGG's correction runs: mode ``jagg`` with a rate > 0."""
        return self.mode == "jagg" and any(r > 0 for r in self.probs)

    @property
    def unbiased(self) -> bool:
        """Whether the estimator's expectation is exact's gradient by construction: exact, random timestep
        subsampling, and JAGG with the correction on every interval (``correction_p`` or every ``correction_probs``
        > 0). Plain JAGG's interpolation error repeats from batch to batch."""
        return self.mode in ("exact", "subsample") or (self.mode == "jagg" and all(r > 0 for r in self.probs))

    @property
    def random(self) -> bool:
        """Whether one update's gradient is a random draw (the correction's picks, interval or step subsampling)."""
        return (self.corrects or (self.mode != "subsample" and self.interval_frac < 1)
                or (self.mode == "subsample" and self.subsample_frac < 1))

    def exact(self) -> "EstimatorConfig":
        """The exact estimator of the same loss (mode ``exact``, every interval): what this one estimates."""
        return replace(self, mode="exact", interval_frac=1.0)

    def plain(self) -> "EstimatorConfig":
        """The same estimator without unbiased JAGG's correction (``correction_p`` 0, no ``correction_probs``): in mode
        ``jagg`` the paper's plain JAGG, whose error the correction removes."""
        return replace(self, correction_p=0.0, correction_probs=None)

    def candidate_base(self) -> "EstimatorConfig":
        """This section in mode ``jagg`` without candidates: what mode auto's candidates (and ``jagg bench meter``'s
        ``--estimator`` specs on an auto config) build on."""
        return replace(self, mode="jagg", candidates=[])

    def candidate_configs(self) -> dict[str, "EstimatorConfig"]:
        """mode auto's estimators, ``{name: config}``: ``exact`` (this section's loss in mode ``exact``) first, then each
        of :attr:`candidates` (``NAME:KEY=VALUE,...``: its keys on top of this section's in mode ``jagg``). A
        candidate that does not parse, repeats a name, sets a key it may not (:data:`NOT_CANDIDATE_KEYS`, mode auto) or
        makes an invalid estimator is an error naming it."""
        base = self.candidate_base()
        out = {"exact": base.exact()}
        for spec in self.candidates:
            name, defines, _ = spec.partition(":")
            where = f"estimator.candidates: {spec!r}"
            if name in out or not name.strip() or name != name.strip():
                raise ValueError(f"{where}: {'the name is given twice' if name in out else 'give it a name'}; each "
                                 f"candidate is NAME:KEY=VALUE,... with a name of its own, e.g. {DEFAULT_CANDIDATES[0]!r}")
            if name == "exact" and not defines:
                continue
            if not defines or name == "exact":
                split = " (a YAML list splits at commas: quote each candidate, e.g. --set 'estimator.candidates=[" \
                        "\"s4:knots=shared,window=4\"]')" if "=" in name else ""
                raise ValueError(f"{where}: give its estimator keys, NAME:KEY=VALUE,... (only 'exact' stands alone, "
                                 f"and it is always measured), e.g. {DEFAULT_CANDIDATES[0]!r}{split}")
            keys = {k.removeprefix("estimator."): _spec_value(v) for k, v in parse_spec(spec, where)[1].items()}
            barred = [k for k in keys if k in NOT_CANDIDATE_KEYS] + (["mode"] if keys.get("mode") == AUTO else [])
            if barred:
                raise ValueError(f"{where}: {barred[0]!r} is not a candidate's to set (the loss and the measurement's "
                                 "keys are the section's, for every candidate); set it in estimator: itself")
            try:
                out[name] = EstimatorConfig.from_dict({**base.to_dict(), **keys})
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}: {e}") from None
        return out

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EstimatorConfig":
        """The config of a mapping of its keys; an unknown key is an error naming the closest valid one."""
        known = [f.name for f in fields(cls)]
        for key in d:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"unknown EstimatorConfig key {key!r}{hint} (valid keys: {', '.join(known)})")
        return cls(**d)


def _spec_value(text: str):
    """A value of a ``KEY=VALUE`` spec: a JSON number, ``true``/``false``, ``null`` or list, else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text
