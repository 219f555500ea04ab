"""The shapes trainer's configuration (:class:`ShapesTrainConfig`): one typed dataclass per concern, validated on
creation; the sections both trainers share are :mod:`jagg.trainers.sections`.

Loaded from YAML (by default the main job shipped in the package, :func:`main_job_path`) with
``--set section.key=value`` overrides; ``jagg train --help`` lists every key with its default and help.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .. import shapes                      # noqa: F401  registers the 'geneval' reward that reward: may name
from ..checks import check_eta, check_positive, is_finite_number
from ..schedule import SHIFT_HINT, check_schedule
from ..infra import config_loader as configuration
from ..infra.config_loader import helped
from .sections import SAMPLE_KEYS, LogSection, RewardSection, SampleBatch, TrainerSections, check_run

DEFAULT_CHECKPOINT = "builtin:tiny_dit"


def main_job_path() -> Path:
    """The main job's YAML shipped inside the package (``jagg/shapes/main_job.yaml``): the one file that
    ``jagg train`` without ``--config`` (from any directory), ``make train`` and the benchmarks read."""
    path = Path(str(resources.files("jagg.shapes") / "main_job.yaml"))
    if not path.is_file():
        raise FileNotFoundError(f"the shipped main-job config {path} is missing; reinstall jagg "
                                "(pip install --force-reinstall jagg) or pass --config")
    return path


def read_prompts(path: str) -> list[str]:
    """Prompts of a text file, one per line (blank lines skipped), each checked against the world's grammar."""
    from ..shapes import parse_prompt

    prompts = []
    for n, line in enumerate(configuration.read_text(path, "sample.prompts_file").splitlines(), 1):
        if line.strip():
            try:
                parse_prompt(line.strip())
            except ValueError as e:
                raise ValueError(f"sample.prompts_file {path!r} line {n}: {e}") from None
            prompts.append(line.strip())
    if not prompts:
        raise ValueError(f"sample.prompts_file {path!r} holds no prompt; put one prompt per line")
    return prompts


@dataclass
class ModelSection:
    checkpoint: str = field(default=DEFAULT_CHECKPOINT, metadata=helped(
        "Pretrained TinyDiT .safetensors to fine-tune; 'builtin:tiny_dit' is the checkpoint shipped with jagg."))

    trainable: str = field(default="all", metadata=helped(
        "Parameters GRPO updates: 'all', or a regular expression over parameter names (re.search), e.g. "
        "'ada|final' for the adaLN modulation and output layers only; the rest stay frozen."))

    def __post_init__(self):
        import re

        if not self.checkpoint:
            raise ValueError("model.checkpoint must be a path or 'builtin:tiny_dit'")
        if self.trainable != "all":
            try:
                re.compile(self.trainable)
            except re.error as e:
                raise ValueError(f"model.trainable {self.trainable!r} is not a valid regular expression: {e}") from None


@dataclass
class SampleSection(SampleBatch):
    """Rollouts of the TinyDiT: the keys both trainers share (:class:`jagg.trainers.sections.SampleBatch`) and the
    sampler's own steps, shift, noise level and guidance (a real model's live in ``pipeline:``)."""

    num_steps: int = field(default=10, metadata=helped("Sampling steps T per trajectory."))
    shift: float = field(default=1.0, metadata=helped("SD3 timestep shift of the sigma schedule (1 = none)."))
    eta: float = field(default=0.7, metadata=helped("SDE noise level (Flow-GRPO's noise_level); its meaning depends on "
                                                   "sde_type."))
    guidance_scale: float = field(default=3.0, metadata=helped("Classifier-free guidance scale w (1 = off)."))
    prompts_file: str | None = field(default=None, metadata=helped(
        "Text file of training prompts, one per line (default: the world's train split)."))

    def __post_init__(self):
        self.check_batch(("num_steps", "prompts_per_iter", "micro_batch"))
        check_positive(self.shift, "sample.shift", SHIFT_HINT)
        check_eta(self.eta, SAMPLE_KEYS)
        if self.guidance_scale < 1:
            raise ValueError(f"sample.guidance_scale must be >= 1; got {self.guidance_scale}")
        self.check_steps(self.num_steps, self.eta)
        if self.prompts_file is not None:
            self.prompts_file = str(self.prompts_file)
            read_prompts(self.prompts_file)  # fail at load, not mid-run

    def prompts(self) -> list[str]:
        """The training prompts: the file's, or the world's train split."""
        from ..shapes import train_prompts

        return read_prompts(self.prompts_file) if self.prompts_file else train_prompts()



@dataclass
class EvalSection:
    every: int = field(default=25, metadata=helped("Evaluate every N iterations (and at the start and end); 0 = off."))
    dense_iterations: int = field(default=0, metadata=helped(
        "Also evaluate every dense_every iterations up to this iteration, where the reward curve rises (more points "
        "to read it from, one evaluation's cost each); 0 = off."))
    dense_every: int = field(default=0, metadata=helped(
        "Iterations between the evaluations up to dense_iterations (with dense_iterations > 0); 0 = off."))
    num_prompts: int = field(default=0, metadata=helped("Test prompts evaluated (0 = all of the test split)."))
    images_per_prompt: int = field(default=2, metadata=helped("Images per test prompt (fixed seeds)."))
    num_steps: int = field(default=10, metadata=helped("ODE steps of the deterministic evaluation sampler."))
    seed: int = field(default=1234, metadata=helped("Seed of the evaluation noise (the same at every evaluation)."))
    grid_size: int = field(default=16, metadata=helped(
        "Images in the saved sample grids: each evaluation's, and the before/after comparison of the first grid_size "
        "test prompts written at the end of the run (samples/comparison.png; a multiple of 8)."))
    warn_drop: float = field(default=0.05, metadata=helped(
        "Warn (once) when the held-out reward falls more than this below its best so far; 0 = off."))
    warn_empty: float = field(default=0.1, metadata=helped(
        "Warn (once) when the fraction of evaluation images with no detected object rises more than this above the "
        "starting model's; 0 = off."))
    warn_background: float = field(default=5.0, metadata=helped(
        "Warn (once) when the background measure (background_rms: RMS distance of the background pixels from the "
        "flat background colour, 0-255 RGB) rises more than this above the starting model's; 0 = off."))

    def due(self, iteration: int, done: bool = False) -> bool:
        """Whether iteration ``iteration`` (counted from 1; ``done``: the last) ends with an evaluation."""
        if not self.every:
            return False
        dense = self.dense_every and iteration <= self.dense_iterations and iteration % self.dense_every == 0
        return bool(done or iteration % self.every == 0 or dense)

    def __post_init__(self):
        for name in ("every", "num_prompts", "dense_iterations", "dense_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"eval.{name} must be >= 0; got {getattr(self, name)}")
        if (self.dense_iterations > 0) != (self.dense_every > 0) or (self.dense_every and not self.every):
            raise ValueError(f"eval.dense_iterations ({self.dense_iterations}) and eval.dense_every "
                             f"({self.dense_every}) go together, both > 0 with eval.every > 0 (got {self.every}), or "
                             "both 0")
        for name in ("images_per_prompt", "num_steps", "grid_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"eval.{name} must be >= 1; got {getattr(self, name)}")
        if self.grid_size % 8 and self.grid_size > 8:
            raise ValueError(f"eval.grid_size must be at most 8 or a multiple of 8 (rows of 8 prompts in the "
                             f"comparison grid); got {self.grid_size}")
        for name in ("warn_drop", "warn_empty", "warn_background"):
            value = getattr(self, name)
            if not is_finite_number(value) or value < 0:
                raise ValueError(f"eval.{name} must be a finite number >= 0 (0 = off); got {value!r}")


@dataclass
class ShapesTrainConfig(TrainerSections):
    """Everything one ``jagg train`` run on the shapes world needs (saved into every checkpoint)."""

    model: ModelSection = field(default_factory=ModelSection)
    sample: SampleSection = field(default_factory=SampleSection)
    reward: RewardSection = field(default_factory=RewardSection)
    eval: EvalSection = field(default_factory=EvalSection)
    log: LogSection = field(default_factory=LogSection)

    def __post_init__(self):
        super().__post_init__()
        s = self.sample
        self.check_sizes()                     # first: the checks after it build arrays of the sizes it bounds
        check_run(s, self.estimator, s.num_steps, "sample.num_steps")

    def sample_size(self) -> tuple[int, int, str]:
        """One sample's float32 latent numbers and image bytes (the TinyDiT's), and the keys that set them (none)."""
        from ..infra.sizes import TINY_DIT_LATENT

        return TINY_DIT_LATENT, TINY_DIT_LATENT, "the TinyDiT's 32 x 32"

    def check_sizes(self) -> None:
        """Sizes in range that break the run, refused at load naming the key: a shift that leaves the sampling or the
        evaluation schedule without distinct sigmas, more test prompts than the test split holds, and a batch or an
        evaluation whose arrays alone need more memory than this machine has (:mod:`jagg.infra.sizes`)."""
        from ..shapes import test_prompts
        from ..infra.sizes import TINY_DIT_LATENT, check_eval_counts, check_memory, check_run_counts, images_bytes

        s, e, est = self.sample, self.eval, self.estimator
        check_run_counts(s.prompts_per_iter, s.group_size, s.num_steps, self.grpo.inner_epochs, TINY_DIT_LATENT,
                         TINY_DIT_LATENT, f"sample.num_steps={s.num_steps}", "sample.num_steps",
                         (est.preflight_batches, est.preflight_draws) if est.mode == "auto" else None)
        available = len(test_prompts())
        if e.num_prompts > available:
            raise ValueError(f"eval.num_prompts={e.num_prompts} is more than the {available} prompts of the test "
                             "split; lower it (0 = all of them)")
        if e.grid_size > available:
            raise ValueError(f"eval.grid_size={e.grid_size} is more than the {available} prompts of the test split "
                             "(the comparison grid shows one each, in rows of 8); lower it to at most "
                             f"{available - available % 8}")
        images = (e.num_prompts or available) * e.images_per_prompt
        check_memory(images_bytes(images), f"eval.images_per_prompt={e.images_per_prompt}: an evaluation's "
                     f"{images} images", "lower eval.images_per_prompt")
        check_eval_counts(images, e.num_steps, f"eval.images_per_prompt={e.images_per_prompt}", "eval.num_steps")
        check_schedule(s.num_steps, s.shift, "sample.shift", "sample.num_steps")
        check_schedule(e.num_steps, s.shift, "sample.shift", "eval.num_steps")
