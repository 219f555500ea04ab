"""What the launcher asks of ``jagg train``: an ``accelerate launch`` config's settings, read from the environment
that ``accelerate launch`` gives every process, each honoured or refused naming its key.

``accelerate launch --config_file X.yaml -m jagg.cli train ...`` turns the config's keys into environment variables
(``mixed_precision`` -> ``ACCELERATE_MIXED_PRECISION``, ``fsdp_config.fsdp_reshard_after_forward`` ->
``FSDP_RESHARD_AFTER_FORWARD``, ...) and starts the processes through torchrun. :func:`read_launch` reads them with
the meaning accelerate gives them (its ``FullyShardedDataParallelPlugin`` for ``fsdp_version: 2``) and returns a
:class:`LaunchSettings`; a setting ``jagg train`` does not run raises a ``ValueError`` naming the config key and what
to set instead. Nothing is ignored: every variable accelerate sets for a process is in :data:`HANDLED` with what jagg
does with it. ``torchrun`` alone sets none of them (:attr:`LaunchSettings.launcher` ``"torchrun"``).

==========================================  =========================================================================
accelerate config key                       what ``jagg train`` does with it
==========================================  =========================================================================
``distributed_type: MULTI_GPU``             DDP (:mod:`jagg.infra.engine`)
``distributed_type: FSDP``                  FSDP2 ``fully_shard`` (``fsdp_version: 2``; 1 is refused)
``distributed_type: DEEPSPEED``, ...        refused (DeepSpeed, Megatron-LM, a parallelism config, SageMaker)
``mixed_precision``                         ``no``; ``bf16``: fp32 master weights, bf16 compute (DDP:
                                            ``pipeline.autocast``; FSDP: ``MixedPrecisionPolicy(param_dtype=bf16,
                                            reduce_dtype=fp32)``); ``fp16``, ``fp8`` refused (no gradient scaler)
``dynamo_backend``                          ``NO``; a compiler backend is refused
``fsdp_auto_wrap_policy``                   ``TRANSFORMER_BASED_WRAP`` (one unit per block class), ``NO_WRAP`` (the
                                            root only, accelerate's default); ``SIZE_BASED_WRAP`` refused
``fsdp_transformer_layer_cls_to_wrap``      the block classes (unset: the model's ``_no_split_modules``)
``fsdp_reshard_after_forward``              ``fully_shard(reshard_after_forward=...)`` (false: ZeRO-2-like)
``fsdp_sharding_strategy``                  FSDP1's name for it: ``FULL_SHARD`` (accelerate's default); others refused
``fsdp_activation_checkpointing``           ``pipeline.gradient_checkpointing`` (per block, diffusers' own)
``fsdp_state_dict_type``                    ``SHARDED_STATE_DICT`` (torch.distributed.checkpoint); others refused
``fsdp_offload_params``, ``fsdp_activation_checkpointing_offload``, ``fsdp_ignored_modules``, ``fsdp_forward_prefetch``,
``fsdp_backward_prefetch``                  refused when set (CPU offload, FSDP1 prefetching)
``fsdp_use_orig_params``,                   obsolete in FSDP2, as accelerate says: FSDP2 trains the original
``fsdp_sync_module_states``,                parameters, and every process loads the same files and seeds its LoRA
``fsdp_cpu_ram_efficient_loading``          alike, then keeps only its shard (accelerate's FSDP2 path for a model
                                            not loaded through transformers)
``fsdp_min_num_params``                     read by ``SIZE_BASED_WRAP`` only (refused)
``use_cpu``                                 ``pipeline.device`` cpu (a ``cuda`` device is refused)
``enable_cpu_affinity``, ``debug``          refused (accelerate's own process setup, which jagg does not run)
==========================================  =========================================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

# variables accelerate launch sets that only matter with a setting refused here, or to the launcher itself
_FOLLOWERS = ("ACCELERATE_DYNAMO_MODE", "ACCELERATE_DYNAMO_USE_FULLGRAPH", "ACCELERATE_DYNAMO_USE_DYNAMIC",
              "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "FSDP_MIN_NUM_PARAMS", "FSDP_VERSION",
              "ACCELERATE_CONFIG_DS_FIELDS")
# every environment variable accelerate launch sets for a process that jagg reads (or knows to leave alone)
HANDLED = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED",
           "ACCELERATE_USE_MEGATRON_LM", "ACCELERATE_USE_PARALLELISM_CONFIG", "ACCELERATE_USE_SAGEMAKER",
           "ACCELERATE_USE_CPU", "ACCELERATE_CPU_AFFINITY", "ACCELERATE_DEBUG_MODE", "FSDP_SHARDING_STRATEGY",
           "FSDP_RESHARD_AFTER_FORWARD", "FSDP_OFFLOAD_PARAMS", "FSDP_AUTO_WRAP_POLICY", "FSDP_TRANSFORMER_CLS_TO_WRAP",
           "FSDP_BACKWARD_PREFETCH", "FSDP_STATE_DICT_TYPE", "FSDP_FORWARD_PREFETCH", "FSDP_USE_ORIG_PARAMS",
           "FSDP_CPU_RAM_EFFICIENT_LOADING", "FSDP_SYNC_MODULE_STATES", "FSDP_ACTIVATION_CHECKPOINTING",
           "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "FSDP_IGNORED_MODULES", *_FOLLOWERS)

_REFUSED_ENGINES = {"ACCELERATE_USE_DEEPSPEED": "distributed_type: DEEPSPEED",
                    "ACCELERATE_USE_MEGATRON_LM": "distributed_type: MEGATRON_LM",
                    "ACCELERATE_USE_PARALLELISM_CONFIG": "parallelism_config",
                    "ACCELERATE_USE_SAGEMAKER": "compute_environment: AMAZON_SAGEMAKER"}
# FSDP settings refused when true (or set), with why
_REFUSED_FSDP = {
    "FSDP_OFFLOAD_PARAMS": ("fsdp_offload_params", "CPU offload of the parameters is not run by jagg train; set it "
                            "to false (more processes shard further)"),
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": ("fsdp_activation_checkpointing_offload", "offloading the checkpointed "
                                              "activations is not run by jagg train; set it to false"),
    "FSDP_FORWARD_PREFETCH": ("fsdp_forward_prefetch", "FSDP1's forward prefetching (accelerate refuses it with "
                              "fsdp_version 2 too); set it to false"),
}


def _true(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "y", "on")


@dataclass(frozen=True)
class LaunchSettings:
    """What the launcher asks for (:func:`read_launch`).

    Attributes:
        launcher: ``"accelerate"`` (``accelerate launch``) or ``"torchrun"`` (torchrun, or no launcher at all).
        strategy: ``"ddp"`` or ``"fsdp"`` from accelerate's ``distributed_type``; None under torchrun (the config's
            ``distributed.strategy`` decides).
        mixed_precision: ``"bf16"`` or None (accelerate's ``mixed_precision``).
        wrap: ``"blocks"`` (``TRANSFORMER_BASED_WRAP``), ``"root"`` (``NO_WRAP``) or None (not set).
        wrap_classes: ``fsdp_transformer_layer_cls_to_wrap`` as a tuple of class names, or None.
        reshard_after_forward: ``fsdp_reshard_after_forward``, or None.
        activation_checkpointing: ``fsdp_activation_checkpointing``.
        use_cpu: accelerate's ``use_cpu``.
    """

    launcher: str = "torchrun"
    strategy: str | None = None
    mixed_precision: str | None = None
    wrap: str | None = None
    wrap_classes: tuple[str, ...] | None = None
    reshard_after_forward: bool | None = None
    activation_checkpointing: bool = False
    use_cpu: bool = False


def _refuse(key: str, why: str) -> ValueError:
    return ValueError(f"the accelerate config's {key} is not supported by jagg train: {why} (docs/real_models.md, "
                      "Multi-GPU)")


def _only(env: Mapping[str, str], var: str, key: str, allowed: tuple[str, ...], why: str) -> str:
    """The value of ``var`` in upper case (unset: ``allowed[0]``), refused naming ``key`` unless one of ``allowed``."""
    value = env.get(var, allowed[0]).strip().upper() or allowed[0]
    if value not in allowed:
        raise _refuse(f"{key}: {value}", why)
    return value


def _check_common(env: Mapping[str, str]) -> str | None:
    """The settings of every accelerate launch: the engine, mixed precision, the compiler; returns the mixed
    precision (``"bf16"`` or None)."""
    for var, key in _REFUSED_ENGINES.items():
        if _true(env.get(var, "false")):
            raise _refuse(key, "jagg train runs DDP (distributed_type: MULTI_GPU) or FSDP2 (distributed_type: FSDP, "
                          "fsdp_version: 2; its fsdp_reshard_after_forward: false shards gradients and optimizer "
                          "state as ZeRO-2 does)")
    mp = env.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    if mp not in ("no", "bf16"):
        raise _refuse(f"mixed_precision: {mp}", "jagg train runs no gradient scaler; use bf16 (fp32 master weights, "
                      "bf16 compute) or no")
    _only(env, "ACCELERATE_DYNAMO_BACKEND", "dynamo_backend", ("NO",), "jagg train does not compile the transformer; "
          "set it to 'NO'")
    for var, key in (("ACCELERATE_CPU_AFFINITY", "enable_cpu_affinity"), ("ACCELERATE_DEBUG_MODE", "debug")):
        if _true(env.get(var, "false")):
            raise _refuse(f"{key}: true", "it configures accelerate's own process setup and operations, which jagg "
                          "train does not use; set it to false")
    return None if mp == "no" else mp


def _read_fsdp(env: Mapping[str, str]) -> dict:
    """The ``fsdp_config`` keys of an FSDP launch (accelerate's FSDP2 meaning), or a refusal naming one."""
    if env.get("FSDP_VERSION", "1").strip() != "2":
        raise _refuse(f"fsdp_version: {env.get('FSDP_VERSION', '1')}", "jagg train shards with FSDP2 "
                      "(torch's fully_shard); set fsdp_version: 2")
    for var, (key, why) in _REFUSED_FSDP.items():
        if _true(env.get(var, "false")):
            raise _refuse(f"{key}: true", why)
    if env.get("FSDP_IGNORED_MODULES"):
        raise _refuse("fsdp_ignored_modules", "every transformer weight is sharded or trained; remove the key")
    _only(env, "FSDP_BACKWARD_PREFETCH", "fsdp_backward_prefetch", ("NO_PREFETCH",), "FSDP1's setting (FSDP2 "
          "prefetches by itself); remove the key")
    _only(env, "FSDP_SHARDING_STRATEGY", "fsdp_sharding_strategy", ("FULL_SHARD", "1"), "FSDP1's name; with "
          "fsdp_version 2 say it with fsdp_reshard_after_forward (true: FULL_SHARD, false: SHARD_GRAD_OP)")
    _only(env, "FSDP_STATE_DICT_TYPE", "fsdp_state_dict_type", ("SHARDED_STATE_DICT",), "jagg train checkpoints the "
          "shards with torch.distributed.checkpoint and exports the gathered weights once, at the end; set "
          "SHARDED_STATE_DICT")
    reshard = env.get("FSDP_RESHARD_AFTER_FORWARD", "true").strip()
    reshard = {"FULL_SHARD": "true", "SHARD_GRAD_OP": "false"}.get(reshard.upper(), reshard)
    if reshard.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise _refuse(f"fsdp_reshard_after_forward: {reshard}", "FSDP2 takes true or false")
    policy = _only(env, "FSDP_AUTO_WRAP_POLICY", "fsdp_auto_wrap_policy", ("NO_WRAP", "TRANSFORMER_BASED_WRAP"),
                   "jagg train wraps whole transformer blocks; set TRANSFORMER_BASED_WRAP (optionally with "
                   "fsdp_transformer_layer_cls_to_wrap) or NO_WRAP")
    classes = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP")
    return {"wrap": "blocks" if policy == "TRANSFORMER_BASED_WRAP" else "root",
            "wrap_classes": tuple(c.strip() for c in classes.split(",") if c.strip()) if classes else None,
            "reshard_after_forward": _true(reshard),
            "activation_checkpointing": _true(env.get("FSDP_ACTIVATION_CHECKPOINTING", "false"))}


def read_launch(env: Mapping[str, str] | None = None) -> LaunchSettings:
    """The launcher's settings from ``env`` (default: this process's environment): an ``accelerate launch``'s when
    it set ``ACCELERATE_MIXED_PRECISION`` (every accelerate launch does), else torchrun's (nothing asked). Raises a
    ``ValueError`` naming the first accelerate config key that ``jagg train`` does not run."""
    env = os.environ if env is None else env
    if "ACCELERATE_MIXED_PRECISION" not in env and not any(v in env for v in _REFUSED_ENGINES):
        return LaunchSettings()
    mixed = _check_common(env)
    fsdp = _read_fsdp(env) if _true(env.get("ACCELERATE_USE_FSDP", "false")) else None
    return LaunchSettings(launcher="accelerate", strategy="fsdp" if fsdp else "ddp", mixed_precision=mixed,
                          use_cpu=_true(env.get("ACCELERATE_USE_CPU", "false")), **(fsdp or {}))
