"""The configuration of ``jagg train`` on a real diffusers model: :class:`DiffusersTrainConfig` and its sections.

A YAML with a top-level ``pipeline:`` section (``configs/sd35_medium.yaml``, ``configs/flux_dev.yaml``,
``configs/qwen_image.yaml``) is a real-model config (:func:`has_pipeline_section`); :func:`load_config` reads it with
``--set`` overrides. Sections:
``pipeline:`` (:class:`jagg.integrations.config.PipelineConfig`, the model), ``sample:`` (:class:`DiffusersSampleConfig`,
the prompts file and the batch), ``estimator:``, ``optim:``, ``grpo:``, ``reward:`` or ``reward_server:``, ``log:``
(:class:`DiffusersLogConfig`), ``distributed:`` (:class:`DistributedConfig`, several processes), and ``seed``,
``threads``. Each value is checked when the config is built, with an error
naming the key; the trainer is :mod:`jagg.trainers.diffusers`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..checks import Keys
from ..integrations.config import PipelineConfig
from ..rewards.client import RewardClient
from ..infra import config_loader as configuration
from .sections import LogConfig, RewardConfig, SampleBatch, TrainerSections, _help, check_run, sde_window_field


@dataclass
class DiffusersSampleConfig(SampleBatch):
    """Rollouts of a real model. Steps, eta, shift and guidance are the model's and live in ``pipeline:``; the
    shapes trainer's ``SampleConfig`` does not fit (its prompt file must parse in the shapes-world grammar)."""

    prompts_file: str | None = field(default=None, metadata=_help(
        "Required: text file of training prompts, one per line (blank lines skipped)."))
    prompts_per_iter: int = field(default=8, metadata=_help(
        "Distinct prompts per iteration, over all processes (Flow-GRPO: 48 on 32 GPUs)."))
    group_size: int = field(default=8, metadata=_help("Images per prompt: the size of a prompt group (Flow-GRPO: 24)."))
    shared_noise: bool = field(default=False, metadata=_help("Share the initial noise within a prompt group."))
    timestep_fraction: float = field(default=1.0, metadata=_help(
        "Train the first fraction of the pipeline.num_steps steps (all steps are SDE steps)."))
    sde_window: list[int] | None = sde_window_field("sde_window")
    sde_window_schedule: str = sde_window_field("sde_window_schedule")
    sde_window_size: int | None = sde_window_field("sde_window_size")
    sde_window_stride: int = sde_window_field("sde_window_stride")
    sde_window_every: int = sde_window_field("sde_window_every")
    sde_type: str = field(default="flow_grpo", metadata=_help(
        "SDE of the sampled steps, with pipeline.eta: 'flow_grpo' (Flow-GRPO), 'dance' (DanceGRPO and the JAGG "
        "authors: constant eta sqrt(-dt) noise) or 'cps' (coefficients-preserving, 0 < eta <= 1, last step outside "
        "the sde_window); docs/design.md §2."))
    micro_batch: int = field(default=8, metadata=_help(
        "Trajectories per transformer call while sampling; also the sampling piece whose SDE noise is seeded by "
        "(seed, iteration, position), so that a rollout does not depend on the number of processes when each "
        "process's shard is a multiple of it."))

    def __post_init__(self):
        self.prompt_lines: list[str] = []                          # the file's prompts, read at load (not a key)
        if self.prompts_file is not None or configuration.required(None, "sample.prompts_file", "a text file with "
                                                                   "one training prompt per line (in the YAML's sample: "
                                                                   "section or --set sample.prompts_file=prompts.txt)"):
            self.prompts_file = str(self.prompts_file)
            self.prompt_lines = configuration.read_prompt_lines(self.prompts_file)   # fail at load, not mid-run
        self.check_batch(("prompts_per_iter", "group_size", "micro_batch"))


@dataclass
class DiffusersLogConfig(LogConfig):
    """:class:`jagg.trainers.sections.LogConfig` with its own default run directory."""

    output_dir: str = field(default="runs/real", metadata=_help(
        "Run directory: metrics, sample images, checkpoints and LoRA adapters."))
    sample_images: int = field(default=8, metadata=_help(
        "Rollout images saved as samples/iter_<n>.png at each checkpoint (videos: an animated .gif; 0 = none)."))

    def __post_init__(self):
        super().__post_init__()
        if self.sample_images < 0:
            raise ValueError(f"log.sample_images must be >= 0; got {self.sample_images}")


@dataclass
class DistributedConfig:
    """How several processes (``torchrun`` / ``accelerate launch``) share the trainable transformer
    (:mod:`jagg.infra.engine`). Under ``accelerate launch`` its config's settings apply as well
    (:mod:`jagg.infra.launch`); a key set both here and there must agree."""

    strategy: str = field(default="auto", metadata=_help(
        "'ddp': the transformer replicated on every process (DistributedDataParallel; LoRA, or a model that fits one "
        "GPU); 'fsdp': FSDP2 fully_shard per transformer block, parameters, gradients and AdamW state sharded (full "
        "fine-tuning of a model that does not fit one GPU; the KL reference copy sharded too); 'auto': the accelerate "
        "config's distributed_type under accelerate launch, else ddp. One process: neither."))
    wrap_classes: list[str] | None = field(default=None, metadata=_help(
        "fsdp: the module classes sharded as one unit each; null = the accelerate config's "
        "fsdp_transformer_layer_cls_to_wrap, else the transformer's own blocks (its _no_split_modules: SD3 "
        "JointTransformerBlock; FLUX FluxTransformerBlock, FluxSingleTransformerBlock; Qwen-Image "
        "QwenImageTransformerBlock)."))
    reshard_after_forward: bool | None = field(default=None, metadata=_help(
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
    sample: DiffusersSampleConfig = field(default_factory=DiffusersSampleConfig)
    reward: RewardConfig | None = field(default=None, metadata=_help(
        "Local reward, {name: <registry name | package.module:function>} or {weights: {name: w, ...}} "
        "(jagg.trainers.sections.RewardConfig); the function takes (images uint8 [N,H,W,3], prompts, metadata). "
        "Set this or reward_server."))
    reward_server: RewardClient | None = field(default=None, metadata=_help(
        "HTTP reward server, jagg.rewards.RewardClient arguments {"
        + ", ".join(f.name for f in dataclasses.fields(RewardClient))
        + "} (token: better in $JAGG_REWARD_TOKEN, every checkpoint saves the config). Set this or reward."))
    log: DiffusersLogConfig = field(default_factory=DiffusersLogConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig, metadata=_help(
        "Several processes: DDP or FSDP2 sharding (see DistributedConfig); ignored by a single process."))

    def __post_init__(self):
        if isinstance(self.reward, dict):
            self.reward = configuration.from_dict(RewardConfig, self.reward, "reward")
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
        if self.optim.ema_decay > 0:
            raise ValueError("optim.ema_decay is not supported by the diffusers trainer; set it to 0")
        check_run(self.sample, self.estimator, self.pipeline.num_steps, "pipeline.num_steps", self.pipeline.eta,
                  Keys("sample.", eta="pipeline.eta", num_steps="pipeline.num_steps"))
        self.check_sizes()
        if self.estimator.kl_beta > 0 and not self.pipeline.lora.enabled and not self.pipeline.keep_reference:
            raise ValueError("estimator.kl_beta > 0 with full fine-tuning (pipeline.lora.enabled: false) needs a "
                             "reference model: set pipeline.keep_reference: true, or estimator.kl_beta: 0")


    def check_sizes(self) -> None:
        """Sizes in range that break the run, refused at load naming the key: a ``pipeline.shift`` that leaves a
        schedule without distinct sigmas, and a batch whose latents and images alone need more memory than this
        machine has (16 latent channels at 1/8 of ``pipeline.resolution``: :mod:`jagg.infra.sizes`)."""
        from ..schedule import check_schedule
        from ..infra.sizes import check_rollout_memory

        p, s = self.pipeline, self.sample
        if p.shift is not None:
            check_schedule(p.num_steps, p.shift, "pipeline.shift", "pipeline.num_steps")
            check_schedule(p.eval_num_steps, p.shift, "pipeline.shift", "pipeline.eval_num_steps")
        check_rollout_memory(s.prompts_per_iter, s.group_size, p.num_steps, 16 * (p.resolution // 8) ** 2,
                             3 * p.resolution ** 2, f"pipeline.num_steps={p.num_steps} at "
                             f"pipeline.resolution={p.resolution}")


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
