"""The cost model: the rows an estimator runs against exact's (:func:`cost_limit`, :func:`estimator_limit`, the
training phase's limit), and time on other hardware, the iteration ratio a named cost structure projects for them.

Per-update efficiency does not depend on the machine; the iteration ratio does. On this CPU the TinyDiT's backward
costs about half its forward, and sampling is a large share of an iteration, so CPU seconds undervalue a saved row;
on a GPU a transformer's backward is about two forwards (full fine-tuning), and Flow-GRPO's CFG sends both branches
through training. A projected time efficiency is therefore the per-update efficiency (measured, or the meter's)
times the iteration ratio of a stated cost structure (docs/design.md §3.7, §3.8):

    one forward of one branch = 1, a backward = B_F
    rollout, per sample:            rollout_steps x cfg_rollout                      (no grad)
    a training row:                 cfg_train x (1 + B_F) + (cfg_rollout - cfg_train)  (branches without grad: a forward)
    a no-grad row (intermediate: fresh): cfg_rollout
    exact, per sample:              rollout + train_steps x training row
    an estimator, per sample:       rollout + train_steps x (rows / rows_exact x training row + nograd / rows_exact x cfg_rollout)

The estimator's rows and no-grad rows are measured on the job (per sample, as fractions of exact's rows) and carried
over to the structure's trained steps. Rewards and decoding are left out (0). :data:`PRESETS` names the structures of
real jobs; ``--cost KEY=VALUE,...`` states another; ``--gpu-bench-json`` replaces ``B_F`` by the one
``benchmarks/gpu_bench.py`` measured on a GPU for the structure's model and resolution.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from .checks import check_count, check_positive, is_finite_number, parse_spec, shown
from .knots import drawn_count, intervals_of
from .trajectory import select_train_steps


@dataclass(frozen=True)
class CostStructure:
    """The cost of one GRPO iteration per sample, in forwards of one network branch (module docstring).

    Attributes:
        name: what the numbers describe (a preset's name, or "custom").
        B_F: a backward's cost over a forward's (about 2 for full fine-tuning, about 1 with LoRA; gradient
            checkpointing adds one forward).
        cfg_rollout: network branches per guided forward (2 with classifier-free guidance, else 1).
        cfg_train: the branches that go through training with grad (Flow-GRPO's SD3: both; a detached unconditional
            branch: 1).
        rollout_steps: sampling steps per trajectory.
        train_steps: trained steps per trajectory (exact's rows per sample).
        model, resolution: the ``benchmarks/gpu_bench.py`` model and image size whose measured B/F can replace
            ``B_F`` (None: none stated).
        about: where the numbers come from.
    """

    name: str
    B_F: float
    cfg_rollout: int
    cfg_train: int
    rollout_steps: int
    train_steps: int
    model: str | None = None
    resolution: int | None = None
    about: str = ""

    def __post_init__(self):
        check_positive(self.B_F, f"{self.name}: B_F", "a backward's cost over a forward's")
        for key in ("cfg_rollout", "cfg_train", "rollout_steps", "train_steps"):
            object.__setattr__(self, key, check_count(getattr(self, key), f"{self.name}: {key}"))   # frozen
        if self.cfg_train > self.cfg_rollout:
            raise ValueError(f"{self.name}: cfg_train ({self.cfg_train}) cannot exceed cfg_rollout "
                             f"({self.cfg_rollout}), the branches of a guided forward")
        if self.train_steps > self.rollout_steps:
            raise ValueError(f"{self.name}: train_steps ({self.train_steps}) cannot exceed rollout_steps "
                             f"({self.rollout_steps})")

    def describe(self) -> str:
        """The parameters, as printed beside a projected number."""
        return (f"{self.name}: B/F {self.B_F:g}, CFG branches {self.cfg_rollout} per forward ({self.cfg_train} with "
                f"grad in training), {self.rollout_steps} rollout steps, {self.train_steps} trained"
                + (f"; {self.about}" if self.about else ""))

    def iteration_ratio(self, rows_fraction: float, nograd_fraction: float = 0.0) -> float:
        """Exact's iteration cost over an estimator's that runs ``rows_fraction`` of exact's training rows with grad
        and ``nograd_fraction`` of them as no-grad forwards (module docstring)."""
        rollout = self.rollout_steps * self.cfg_rollout
        row = self.cfg_train * (1.0 + self.B_F) + (self.cfg_rollout - self.cfg_train)
        exact = rollout + self.train_steps * row
        return exact / (rollout + self.train_steps * (rows_fraction * row + nograd_fraction * self.cfg_rollout))


PRESETS = {
    "flow_grpo_sd35": CostStructure(
        "flow_grpo_sd35", B_F=1.0, cfg_rollout=2, cfg_train=2, rollout_steps=10, train_steps=9, model="sd35m",
        resolution=512, about="Flow-GRPO's SD3.5-Medium as it trains (configs/sd35_medium.yaml): LoRA, CFG with "
        "both branches with grad, 10 sampling steps, timestep_fraction 0.99"),
    "flow_grpo_sd35_full": CostStructure(
        "flow_grpo_sd35_full", B_F=2.0, cfg_rollout=2, cfg_train=2, rollout_steps=10, train_steps=9, model="sd35m",
        resolution=512, about="the same with full fine-tuning"),
    "jagg_authors_qwen_image": CostStructure(
        "jagg_authors_qwen_image", B_F=3.0, cfg_rollout=1, cfg_train=1, rollout_steps=21, train_steps=20,
        model="qwen_image", resolution=720, about="the JAGG authors' Qwen-Image (configs/qwen_image.yaml): full "
        "fine-tuning with gradient checkpointing (one more forward), no guidance, 20 of 21 steps trained"),
    "flow_grpo_wan": CostStructure(
        "flow_grpo_wan", B_F=2.0, cfg_rollout=2, cfg_train=2, rollout_steps=20, train_steps=19, model="wan_1_3b",
        resolution=240, about="Flow-GRPO's Wan 2.1 T2V 1.3B (configs/wan_t2v.yaml, scripts/train_wan2_1.py): LoRA "
        "with gradient checkpointing (B/F 1 plus one forward), CFG 4.5 with both branches with grad, 20 sampling "
        "steps, timestep_fraction 0.99, 33 frames at 240 x 416"),
}
DEFAULT = "flow_grpo_sd35"
KEYS = ("B_F", "cfg_rollout", "cfg_train", "rollout_steps", "train_steps", "model", "resolution")


def job_structure(sample) -> CostStructure:
    """The cost structure of a shapes job (its ``sample:`` section), what ``--cost KEY=VALUE,...`` starts from: its
    sampling and trained steps, its guidance (2 branches per forward above a scale of 1, the unconditional one without
    grad in training, as :class:`jagg.shapes.guided_velocity.GuidedVelocity` runs it) and the cost model's B/F of 2."""
    window = tuple(sample.sde_window) if sample.sde_window else None
    steps = select_train_steps(sample.num_steps, sample.timestep_fraction, window)[0]
    return CostStructure("custom", B_F=2.0, cfg_rollout=2 if sample.guidance_scale > 1 else 1, cfg_train=1,
                         rollout_steps=sample.num_steps, train_steps=int(steps.numel()))


def config_structure(cfg) -> CostStructure:
    """The cost structure of a trainer config: a shapes job's (:func:`job_structure`), or a diffusers config's (a
    ``pipeline:`` section): its sampling and trained steps, its guidance (both branches through training unless
    ``pipeline.detach_uncond``) and the cost model's B/F of 2."""
    p = getattr(cfg, "pipeline", None)
    if p is None:
        return job_structure(cfg.sample)
    guided = 2 if p.cfg_scale > 1 else 1
    trained = int(cfg.sample.sde_steps(p.num_steps, 0)[0].numel())     # an iteration's trained steps (the same in each)
    return CostStructure("custom", B_F=2.0, cfg_rollout=guided, cfg_train=1 if p.detach_uncond else guided,
                         rollout_steps=p.num_steps, train_steps=trained)


def default_cost(cfg) -> str:
    """``--cost``'s default preset for a trainer config: for a diffusers one (a ``pipeline:`` section) its family's
    (``pipeline.cost_preset``, from the family's record: Wan ``flow_grpo_wan``, Qwen-Image
    ``jagg_authors_qwen_image``; where it names none ``flow_grpo_sd35``, or ``flow_grpo_sd35_full`` with full
    fine-tuning), :data:`DEFAULT` for the shapes world."""
    p = getattr(cfg, "pipeline", None)
    if p is None:
        return DEFAULT
    return p.cost_preset or (DEFAULT if p.lora.enabled else f"{DEFAULT}_full")


def parse_cost(spec: str, job: CostStructure) -> CostStructure:
    """``PRESET``, ``PRESET:KEY=VALUE,...`` or ``KEY=VALUE,...`` (keys of :data:`KEYS`; unset ones are ``job``'s, the
    job the numbers were measured on) -> its :class:`CostStructure`."""
    name, colon, rest = spec.partition(":")
    if not colon and "=" in name:
        base, rest = dataclasses.replace(job, name="custom", about=""), name
    elif name in PRESETS:
        base = PRESETS[name]
    else:
        raise ValueError(f"--cost {spec!r}: unknown cost structure {name!r}; presets: {', '.join(PRESETS)}, or "
                         f"KEY=VALUE,... of {', '.join(KEYS)}")
    values = {}
    try:
        items = parse_spec(":" + rest, "--cost")[1]
    except ValueError as e:                                 # name the spec as given
        raise ValueError(f"--cost {spec!r}: {str(e).split(': ', 1)[1]} with KEY one of {', '.join(KEYS)}") from None
    for key, value in items.items():
        if key not in KEYS:
            raise ValueError(f"--cost {spec!r}: {key!r} is not KEY=VALUE with KEY one of {', '.join(KEYS)}")
        values[key] = _value(key, value, spec)
    if not values:
        return base
    return dataclasses.replace(base, name=base.name if base.name == "custom" else f"{base.name} (changed)", **values)


def _value(key: str, text: str, spec: str):
    if key == "model":
        return text
    try:
        return float(text) if key == "B_F" else int(text)
    except ValueError:
        raise ValueError(f"--cost {spec!r}: {key}={text!r} is not a{' number' if key == 'B_F' else 'n integer'}") from None


def gpu_bench_b_over_f(path: str | Path, model: str | None, resolution: int | None) -> tuple[float, str]:
    """The backward-over-forward ratio ``benchmarks/gpu_bench.py`` measured for ``model`` at ``resolution`` (its JSON's
    ``costs`` records) and a line saying where it comes from. Errors name the file and the key at fault
    (:func:`read_gpu_bench`)."""
    costs, cfg, env = read_gpu_bench(path)
    where = f"--gpu-bench-json {str(path)!r}"
    if model is None:
        raise ValueError("--gpu-bench-json needs a cost structure that names its model and resolution (a preset, or "
                         "--cost ...,model=sd35m,resolution=512)")
    hit = [c for c in costs if c.get("model") == model and c.get("resolution") == resolution
           and c.get("b_over_f") is not None]
    if not hit:
        have = ", ".join(f"{c.get('model')} at {c.get('resolution')}" for c in costs)
        raise ValueError(f"{where} has no B/F of {model} at {resolution} px (it has: {have}); "
                         "run benchmarks/gpu_bench.py --models ... --resolutions ... for it, or --cost ...,resolution=")
    b_f = hit[0]["b_over_f"]
    if not is_finite_number(b_f) or b_f <= 0:
        raise ValueError(f"{where}: costs[{costs.index(hit[0])}].b_over_f ({model} at {resolution} px) must be a "
                         f"finite number > 0 (a backward's time over a forward's); got {shown(b_f)}")
    tuning = "LoRA" if cfg.get("lora", True) else "full fine-tuning"
    line = (f"B/F {float(b_f):.2f} measured by benchmarks/gpu_bench.py ({model} at {resolution} px, {tuning}"
            f"{', gradient checkpointing' if cfg.get('gradient_checkpointing') else ''}, {cfg.get('dtype', '?')}, "
            f"{env.get('device', '?')})")
    return float(b_f), line


def read_gpu_bench(path: str | Path) -> tuple[list[dict], dict, dict]:
    """The ``costs`` records, ``config`` and ``env`` of a ``benchmarks/gpu_bench.py`` results JSON, checked: a JSON
    object whose ``costs`` is a non-empty list of objects, and whose ``config`` and ``env`` (optional) are objects.
    A ValueError names the file and the key that holds something else."""
    where = f"--gpu-bench-json {str(path)!r}"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{where} cannot be read as JSON: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where} must hold a JSON object (as benchmarks/gpu_bench.py writes); got a "
                         f"{type(data).__name__}")
    costs = data.get("costs")
    if not costs:
        raise ValueError(f"{where} holds no 'costs' records (written by benchmarks/gpu_bench.py since it measures B/F)")
    if not isinstance(costs, list) or not all(isinstance(c, dict) for c in costs):
        bad = costs if not isinstance(costs, list) else next(c for c in costs if not isinstance(c, dict))
        raise ValueError(f"{where}: 'costs' must be a list of records (objects with model, resolution, b_over_f); "
                         f"holds {shown(bad)}")
    for key in ("config", "env"):
        if not isinstance(data.get(key, {}), dict):
            raise ValueError(f"{where}: {key!r} must be an object (key: value); got {shown(data[key])}")
    return costs, data.get("config", {}), data.get("env", {})


def resolve(spec: str | None, job: CostStructure, gpu_bench_json: str | None = None,
            default: str = DEFAULT) -> tuple[CostStructure, str]:
    """The cost structure of ``--cost`` (:func:`parse_cost`; None: ``default``, :func:`default_cost` of the config)
    with ``--gpu-bench-json``'s B/F when given, and its description (:meth:`CostStructure.describe`, and where the B/F
    comes from)."""
    cost = parse_cost(default if spec is None else spec, job)
    if gpu_bench_json is None:
        return cost, cost.describe()
    b_f, where = gpu_bench_b_over_f(gpu_bench_json, cost.model, cost.resolution)
    cost = dataclasses.replace(cost, B_F=b_f)
    return cost, f"{cost.describe()}; {where}"


def add_cost_arguments(parser, what: str) -> None:
    """``--cost`` and ``--gpu-bench-json``, the cost structure of ``what`` (the projected columns), on ``parser``."""
    parser.add_argument("--cost", metavar="SPEC",
                        help=f"the cost structure of {what}: a preset ({', '.join(PRESETS)}), PRESET:KEY=VALUE,... "
                             f"or KEY=VALUE,... [default: {DEFAULT}; a pipeline: config: its family's]")
    parser.add_argument("--gpu-bench-json", metavar="PATH",
                        help="benchmarks/gpu_bench.py's results JSON: its measured B/F replaces B_F")


# ----------------------------------------------------------------------------- the rows of an estimator (docs/design.md §3.7)


def cost_limit(window: int, intermediate: str, f_grad: float = 1.0, f_nograd: float = 1.0,
               backward: float = 2.0, steps: int | None = None, jagg_frac: float = 1.0,
               exact_first: int = 0, exact_last: int = 0, knots: str = "groups", correction_p: float = 0.0,
               correction_probs=None, interval_frac: float = 1.0, off_policy_share: float = 0.0) -> float:
    """Ideal speed-up of JAGG over exact: exact cost / JAGG cost of the trained steps, per sample (expected rows where
    the estimator draws).

    Exact: ``K (F_grad + B)``. JAGG: ``rows (F_grad + B) + nograd F_nograd``, where the rows are the knots plus the
    inner steps of the intervals that run exact, and ``nograd`` the inner steps of the routed intervals under
    ``fresh`` (none under ``interp`` and ``stale``; ``auto`` runs ``fresh`` in the share ``off_policy_share`` of the
    updates: off-policy, ``(U - 1) / U`` with ``U`` updates per iteration). With ``steps=None`` the limit is for one full interval of ``window`` steps: the defaults
    (``B = 2F``, ``F_grad = F_nograd``) give docs/design.md's ``3W / (W + 4)`` (fresh) and ``W / 2`` (interp). With
    ``steps=K`` the ``K`` trained steps are laid out as the estimator lays them out: step groups of ``window`` (the last
    may be shorter), or shared knots every ``window - 1`` steps. Routing: the fraction ``jagg_frac`` of each
    eligible interval (>= 3 steps, not among the first ``exact_first`` / last ``exact_last`` eligible ones) goes
    through JAGG; unbiased JAGG adds, per routed interval, ``p_j`` (``correction_p``, or ``correction_probs[j]``) x its
    inner rows. Interval subsampling (``interval_frac``, ``m`` of the ``n`` intervals per sample) keeps each interval with
    probability ``m / n``; a knot shared by two intervals is a row when the interval that owns its term is drawn or
    the other one is drawn and routed. ``jagg_frac = 0`` with ``interval_frac`` is exact's interval subsampling,
    limit ``n / m``. Pass measured times to get the limit of a given model.
    """
    if intermediate not in ("fresh", "interp", "stale", "auto"):
        raise ValueError(f"intermediate must be 'fresh', 'interp', 'stale' or 'auto'; got {intermediate!r}")
    if not 0.0 <= off_policy_share <= 1.0:
        raise ValueError(f"off_policy_share must be in [0, 1]; got {off_policy_share!r}")
    fresh_share = {"fresh": 1.0, "interp": 0.0, "stale": 0.0, "auto": off_policy_share}[intermediate]
    K = window if steps is None else steps
    layout = "groups" if knots == "groups" else "shared"
    intervals = intervals_of(list(range(K)), layout, window) if window > 2 else [[k] for k in range(K)]
    n = len(intervals)
    m = drawn_count(n, interval_frac)
    keep = m / n                                                                 # P(an interval is drawn)
    out_in = keep - (m * (m - 1) / (n * (n - 1)) if n > 1 else 0.0)              # P(one undrawn, a given other drawn)
    eligible = [j for j, iv in enumerate(intervals) if len(iv) >= 3]
    eligible = eligible[exact_first: len(eligible) - exact_last]
    rates = list(correction_probs) if correction_probs is not None else [correction_p] * n
    routed = [jagg_frac if j in eligible else 0.0 for j in range(n)]
    rows, nograd = 0.0, 0.0
    for j, iv in enumerate(intervals):
        inner = max(len(iv) - 2, 0)
        p = rates[j] if j in eligible else 0.0
        rows += keep * ((1.0 - routed[j]) * inner + routed[j] * p * inner)
        nograd += fresh_share * keep * routed[j] * inner
        if layout == "groups":
            rows += keep * min(len(iv), 2)                                      # its own knots
            continue
        # knots shared: its end knot (and the first interval's start) is its own, a row when it is drawn; the end
        # knot is also a row when only the next interval is drawn and that one is routed
        rows += keep * (2 if j == 0 else 1) + (out_in * routed[j + 1] if j + 1 < n else 0.0)
    return K * (f_grad + backward) / (rows * (f_grad + backward) + nograd * f_nograd)


def estimator_limit(est, steps: int, f_grad: float = 1.0, f_nograd: float = 1.0, backward: float = 2.0,
                    off_policy_share: float = 0.0) -> float:
    """:func:`cost_limit` of an :class:`~jagg.EstimatorConfig` on ``steps`` trained steps: mode ``subsample`` ``K / m``;
    mode ``exact`` 1, or ``n / m`` with ``interval_frac``; mode ``jagg`` its layout, routing, correction and draws
    (``off_policy_share``: the updates that ``intermediate="auto"`` runs ``fresh``)."""
    if est.mode == "subsample":
        return steps / drawn_count(steps, est.subsample_frac)
    if est.mode == "exact" and est.interval_frac >= 1:
        return 1.0
    return cost_limit(est.window, est.intermediate, f_grad, f_nograd, backward, steps=steps,
                      jagg_frac=est.jagg_frac if est.mode == "jagg" else 0.0, exact_first=est.exact_first_intervals,
                      exact_last=est.exact_last_intervals, knots=est.knots, correction_p=est.correction_p,
                      correction_probs=est.correction_probs, interval_frac=est.interval_frac,
                      off_policy_share=off_policy_share)
