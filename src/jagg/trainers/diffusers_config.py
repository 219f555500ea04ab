"""The configuration of ``jagg train`` on a real diffusers model: :class:`DiffusersTrainConfig` and its sections.

A YAML with a top-level ``pipeline:`` section (``configs/sd35_medium.yaml``, ``configs/flux_dev.yaml``,
``configs/qwen_image.yaml``) is a real-model config (:func:`has_pipeline_section`); :func:`load_config` reads it with
``--set`` overrides. Sections:
``pipeline:`` (:class:`jagg.integrations.config.PipelineConfig`, the model), ``sample:`` (:class:`DiffusersSampleSection`,
the prompts file and the batch), ``estimator:``, ``optim:``, ``grpo:``, ``reward:`` or ``reward_server:``, ``log:``
(:class:`DiffusersLogSection`), ``distributed:`` (:class:`DistributedSection`, several processes), and ``seed``,
``threads``. Each value is checked when the config is built, with an error
naming the key; the trainer is :mod:`jagg.trainers.diffusers_trainer`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..checks import Keys, check_seed
from ..integrations.config import PipelineConfig
from ..rewards.client import RewardClient
from ..infra import config_loader as configuration
from ..infra.prompt_sets import PromptSet, eval_set_beside, read_prompt_set
from ..infra.config_loader import helped
from .sections import LogSection, RewardSection, SampleBatch, TrainerSections, check_run


TRAINER_TAG = "jagg.trainers.diffusers"          # written into the trainer's checkpoints (a shapes run's carry none)


@dataclass
class DiffusersSampleSection(SampleBatch):
    """Rollouts of a real model. Steps, eta, shift and guidance are the model's and live in ``pipeline:``; the
    shapes trainer's ``SampleSection`` does not fit (its prompt file must parse in the shapes-world grammar)."""

    prompts_file: str | None = field(default=None, metadata=helped(
        "Required: the training prompts, a .txt (one prompt a line, blank lines skipped), a .jsonl (Flow-GRPO's "
        "train_metadata.jsonl: one JSON object a line with a 'prompt' and any fields the reward reads, passed to it as "
        "that prompt's metadata) or a .json (one list of prompts, strings or such objects)."))

    def __post_init__(self):
        self.prompt_set = PromptSet("", [])                        # the file's prompts and metadata, read at load
        if self.prompts_file is not None or configuration.required(None, "sample.prompts_file", "the training prompts, "
                                                                   "a .txt (one a line) or a .jsonl with metadata (in "
                                                                   "the YAML's sample: section or --set "
                                                                   "sample.prompts_file=prompts.txt)"):
            self.prompts_file = str(self.prompts_file)
            self.prompt_set = read_prompt_set(self.prompts_file)   # fail at load, not mid-run
        self.check_batch(("prompts_per_iter", "group_size", "micro_batch"))

    @property
    def prompt_lines(self) -> list[str]:
        """The training prompts (:attr:`prompt_set`'s)."""
        return self.prompt_set.prompts


@dataclass
class DiffusersEvalSection:
    """Evaluation on a test prompt set, as Flow-GRPO evaluates: every ``every`` iterations (and at the start and the
    end), the deterministic ODE sampler at ``pipeline.eval_num_steps`` on the run's sigma grid, fixed noise, the run's
    guidance and reward, the EMA weights when ``optim.ema_decay > 0``."""

    prompts_file: str | None = field(default=None, metadata=helped(
        "Test prompts, .txt, .jsonl or .json as sample.prompts_file; null: the test set beside sample.prompts_file in "
        "Flow-GRPO's dataset layout (train.txt -> test.txt, train_metadata.jsonl -> test_metadata.jsonl) when that "
        "file exists, else no evaluation (the run's header says so)."))
    every: int = field(default=10, metadata=helped(
        "Evaluate every N iterations, at the start and at the end (0 = off)."))
    num_prompts: int = field(default=0, metadata=helped("Test prompts evaluated: the first N of the set (0 = all)."))
    images_per_prompt: int = field(default=1, metadata=helped("Images per test prompt, each from its own fixed noise."))
    seed: int = field(default=1234, metadata=helped("Seed of the evaluation noise (the same at every evaluation)."))
    grid_size: int = field(default=16, metadata=helped(
        "Images in each evaluation's grid samples/eval_<n>.png (videos: .gif), captioned with prompt and reward."))

    def __post_init__(self):
        for name in ("every", "num_prompts"):
            if isinstance(getattr(self, name), bool) or getattr(self, name) < 0:
                raise ValueError(f"eval.{name} must be an integer >= 0; got {getattr(self, name)!r}")
        for name in ("images_per_prompt", "grid_size"):
            if isinstance(getattr(self, name), bool) or getattr(self, name) < 1:
                raise ValueError(f"eval.{name} must be an integer >= 1; got {getattr(self, name)!r}")
        check_seed(self.seed, "eval.seed")
        self.test_set: PromptSet | None = None                     # resolved by DiffusersTrainConfig (not a key)

    def resolve(self, train_file: str | None) -> None:
        """Read the test set (:attr:`test_set`): ``prompts_file``, or the one beside ``train_file``; a set smaller
        than ``num_prompts`` is refused."""
        path = self.prompts_file if self.prompts_file is not None else (eval_set_beside(train_file)
                                                                          if train_file else None)
        if path is None:
            return
        self.test_set = read_prompt_set(path, "eval.prompts_file" if self.prompts_file is not None else
                                        f"eval.prompts_file (null: {Path(path).name} beside sample.prompts_file)")
        if self.num_prompts > len(self.test_set):
            raise ValueError(f"eval.num_prompts={self.num_prompts} is more than the {len(self.test_set)} prompts of "
                             f"{path}; lower it (0 = all of them)")

    def due(self, iteration: int, done: bool = False) -> bool:
        """Whether iteration ``iteration`` (counted from 1; ``done``: the last) ends with an evaluation."""
        return self.enabled and (done or iteration % self.every == 0)

    @property
    def enabled(self) -> bool:
        """Whether the run evaluates: ``every > 0`` and a test set."""
        return bool(self.every) and self.test_set is not None

    def prompts(self) -> tuple[list[str], list[dict] | None]:
        """The evaluated prompts, each ``images_per_prompt`` times in a row, and their metadata."""
        n = self.num_prompts or len(self.test_set)
        return self.test_set.take([i for i in range(n) for _ in range(self.images_per_prompt)])


@dataclass
class DiffusersLogSection(LogSection):
    """:class:`jagg.trainers.sections.LogSection` with its own default run directory."""

    output_dir: str = field(default="runs/real", metadata=helped(
        "Run directory: metrics, sample images, checkpoints and LoRA adapters."))
    sample_images: int = field(default=8, metadata=helped(
        "Rollout images saved as samples/iter_<n>.png at each checkpoint (videos: an animated .gif; 0 = none)."))

    def __post_init__(self):
        super().__post_init__()
        if self.sample_images < 0:
            raise ValueError(f"log.sample_images must be >= 0; got {self.sample_images}")


@dataclass
class DistributedSection:
    """How several processes (``torchrun`` / ``accelerate launch``) share the trainable transformer
    (:mod:`jagg.infra.engine`). Under ``accelerate launch`` its config's settings apply as well
    (:mod:`jagg.infra.launch`); a key set both here and there must agree."""

    strategy: str = field(default="auto", metadata=helped(
        "'ddp': the transformer replicated on every process (DistributedDataParallel; LoRA, or a model that fits one "
        "GPU); 'fsdp': FSDP2 fully_shard per transformer block, parameters, gradients and AdamW state sharded (full "
        "fine-tuning of a model that does not fit one GPU; the KL reference copy sharded too); 'auto': the accelerate "
        "config's distributed_type under accelerate launch, else ddp. One process: neither."))
    wrap_classes: list[str] | None = field(default=None, metadata=helped(
        "fsdp: the module classes sharded as one unit each; null = the accelerate config's "
        "fsdp_transformer_layer_cls_to_wrap, else the transformer's own blocks (its _no_split_modules: SD3 "
        "JointTransformerBlock; FLUX FluxTransformerBlock, FluxSingleTransformerBlock; Qwen-Image "
        "QwenImageTransformerBlock)."))
    reshard_after_forward: bool | None = field(default=None, metadata=helped(
        "fsdp: free each block's gathered weights after its forward (true: the least memory) or keep them until its "
        "backward (false: less communication; with the sharded gradients and optimizer state, as ZeRO-2); null = the "
        "accelerate config's fsdp_reshard_after_forward, else true."))

    def __post_init__(self):
        from ..infra.engine import STRATEGIES

        if self.strategy not in STRATEGIES:
            raise ValueError(f"distributed.strategy must be one of {STRATEGIES}; got {self.strategy!r}")
        if self.wrap_classes is not None and (not self.wrap_classes
                                              or not all(isinstance(c, str) and c for c in self.wrap_classes)):
            raise ValueError("distributed.wrap_classes must be a non-empty list of class names (or null: the "
                             f"transformer's own blocks); got {self.wrap_classes!r}")
        if self.reshard_after_forward is not None and not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"distributed.reshard_after_forward must be true, false or null; got "
                             f"{self.reshard_after_forward!r}")


@dataclass
class DiffusersTrainConfig(TrainerSections):
    """Everything one ``jagg train`` run on a diffusers model needs, saved into every checkpoint: the model
    (``pipeline:``), the prompts file and batch (``sample:``), a local reward or a reward server, logging, and the
    keys both trainers share (:class:`jagg.trainers.sections.TrainerSections`)."""

    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    sample: DiffusersSampleSection = field(default_factory=DiffusersSampleSection)
    reward: RewardSection | None = field(default=None, metadata=helped(
        "Local reward, {name: <registry name | package.module:function>} or {weights: {name: w, ...}} "
        "(jagg.trainers.sections.RewardSection); the function takes (images uint8 [N,H,W,3], prompts, metadata). "
        "Set this or reward_server."))
    reward_server: RewardClient | None = field(default=None, metadata=helped(
        "HTTP reward server, jagg.rewards.RewardClient arguments {"
        + ", ".join(f.name for f in dataclasses.fields(RewardClient))
        + "} (token: better in $JAGG_REWARD_TOKEN, every checkpoint saves the config). Set this or reward."))
    eval: DiffusersEvalSection = field(default_factory=DiffusersEvalSection)
    log: DiffusersLogSection = field(default_factory=DiffusersLogSection)
    distributed: DistributedSection = field(default_factory=DistributedSection, metadata=helped(
        "Several processes: DDP or FSDP2 sharding (see DistributedSection); ignored by a single process."))

    def __post_init__(self):
        if isinstance(self.reward, dict):
            self.reward = configuration.from_dict(RewardSection, self.reward, "reward")
        if isinstance(self.reward_server, dict):
            if "url" not in self.reward_server:
                raise ValueError("reward_server.url is required, e.g. http://127.0.0.1:8000 (start a server with "
                                 "python -m jagg.rewards.server --reward module:function)")
            self.reward_server = configuration.from_dict(RewardClient, self.reward_server, "reward_server")
        if (self.reward is None) == (self.reward_server is None):
            raise ValueError("set exactly one of reward (e.g. --set reward.name=jpeg_compressibility or "
                             "module:function) and reward_server (an HTTP reward server); "
                             + ("neither is set" if self.reward is None else
                                "both are set: drop one, e.g. --set reward_server=null"))
        super().__post_init__()
        self.eval.resolve(self.sample.prompts_file)
        self.check_sizes()                     # first: the checks after it build arrays of the sizes it bounds
        check_run(self.sample, self.estimator, self.pipeline.num_steps, "pipeline.num_steps", self.pipeline.eta,
                  Keys("sample.", eta="pipeline.eta", num_steps="pipeline.num_steps"))
        if self.estimator.kl_beta > 0 and not self.pipeline.lora.enabled and not self.pipeline.keep_reference:
            raise ValueError("estimator.kl_beta > 0 with full fine-tuning (pipeline.lora.enabled: false) needs a "
                             "reference model: set pipeline.keep_reference: true, or estimator.kl_beta: 0")


    def sample_size(self) -> tuple[int, int, str]:
        """One sample's float32 latent numbers and image bytes, and the keys that set them: 16 latent channels at 1/8
        of ``pipeline.resolution`` x ``pipeline.width``, a video's latent frames (``pipeline.num_frames``)."""
        p = self.pipeline
        (h, w), video = p.size, p.video
        size = f"pipeline.resolution={p.resolution}" + (f", pipeline.width={p.width}" if p.width else "")
        size += f", pipeline.num_frames={p.frames}" if video else ""
        return 16 * (h // 8) * (w // 8) * ((p.frames - 1) // 4 + 1 if video else 1), 3 * h * w * p.frames, size

    def check_sizes(self) -> None:
        """Sizes in range that break the run, refused at load naming the key: a ``pipeline.shift`` that leaves a
        schedule without distinct sigmas, one trajectory (its frames: ``pipeline.num_frames``) or a batch whose latents
        and images alone need more memory than this machine has, and an evaluation whose images do (16 latent channels
        at 1/8 of ``pipeline.resolution`` x ``pipeline.width``, a video's latent frames: :mod:`jagg.infra.sizes`)."""
        from ..schedule import check_schedule
        from ..infra.sizes import check_eval_counts, check_memory, check_run_counts, images_bytes

        p, s, e, est = self.pipeline, self.sample, self.eval, self.estimator
        latent, pixels, size = self.sample_size()
        video = p.video
        check_run_counts(s.prompts_per_iter, s.group_size, p.num_steps, self.grpo.inner_epochs, latent, pixels,
                         f"pipeline.num_steps={p.num_steps} at {size}",
                         f"{'pipeline.num_frames or ' if video else ''}pipeline.resolution or pipeline.num_steps",
                         (est.preflight_batches, est.preflight_draws) if est.mode == "auto" else None)
        check_memory(float(s.batch_size) * p.max_sequence_length * TEXT_WIDTH * 4, f"pipeline.max_sequence_length="
                     f"{p.max_sequence_length}: one iteration's {s.batch_size} prompt embeddings",
                     "lower pipeline.max_sequence_length")
        if p.lora.enabled and p.lora.rank:
            check_memory(float(p.lora.rank) * 2 * LORA_WIDTH * 4, f"pipeline.lora.rank={p.lora.rank}: one adapted "
                         "layer's LoRA matrices", "lower pipeline.lora.rank")
        if e.enabled:
            n = (e.num_prompts or len(e.test_set)) * e.images_per_prompt
            check_memory(images_bytes(n, latent, pixels), f"eval.num_prompts x eval.images_per_prompt: an "
                         f"evaluation's {n} images at {size}", "lower eval.num_prompts or eval.images_per_prompt")
            check_eval_counts(n, p.eval_num_steps, "eval.num_prompts x eval.images_per_prompt",
                              "pipeline.eval_num_steps")
        else:
            check_eval_counts(1, p.eval_num_steps, "one image", "pipeline.eval_num_steps")   # jagg eval's default
        if p.shift is not None:
            check_schedule(p.num_steps, p.shift, "pipeline.shift", "pipeline.num_steps")
            check_schedule(p.eval_num_steps, p.shift, "pipeline.shift", "pipeline.eval_num_steps")


# lower bounds of the families' widths, for memory estimates before a model's files are read: a prompt embedding's
# numbers per token (CLIP-L's 768; the T5 and Qwen encoders' are 4096 and 3584) and a transformer layer's width
# (SD3.5 Medium's and Wan 1.3B's 1536; FLUX's and Qwen-Image's 3072)
TEXT_WIDTH, LORA_WIDTH = 768, 1536


def load_config(path: str | Path, overrides: list[str] | None = None) -> DiffusersTrainConfig:
    """A YAML with a ``pipeline:`` section plus ``--set key=value`` overrides -> :class:`DiffusersTrainConfig`."""
    return configuration.load(DiffusersTrainConfig, path, overrides)


def has_pipeline_section(config: str | Path | dict | None) -> bool:
    """True when ``config`` (a YAML file, or the mapping read from one) has a top-level ``pipeline:`` key: a config
    for the diffusers trainer, not the shapes trainer. An unreadable file is False (the shapes trainer's loading then
    names what is wrong with it)."""
    if isinstance(config, dict):
        return "pipeline" in config
    if config is None or not Path(config).is_file():
        return False
    try:
        return "pipeline" in configuration.read_yaml(config)
    except (OSError, ValueError):
        return False
