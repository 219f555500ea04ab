"""A real-model run as ``jagg eval`` and ``jagg sample`` read it: ``--checkpoint`` a run directory of the diffusers
trainer (its newest checkpoint) or one of its ``ckpt_<n>.pt``.

The model is the run's own (``pipeline:`` of the config saved in the checkpoint: its local directory, sigma grid,
guidance, size) with the checkpoint's trained weights: the EMA's when the run keeps one (``--raw-weights``: the
trained weights themselves); with LoRA, the adapter exported beside the checkpoint (``adapter_<n>/``, its ``ema/``),
with full fine-tuning the checkpoint's weights (an FSDP run's shards, read whole on this one process). ``jagg eval``
evaluates it as the trainer does (:func:`jagg.trainers.diffusers_eval.evaluate_policy`) on the run's test set (or
``--prompt-file``) with the run's reward (or ``--reward``); ``jagg sample`` writes a captioned grid of ``--prompt`` / ``--prompt-file``. Options left
unset take the run's values: ``--steps`` its ``pipeline.eval_num_steps``, ``--guidance-scale`` its
``pipeline.cfg_scale``, ``--shift`` its ``pipeline.shift``, ``--seed`` its ``eval.seed`` (``jagg sample``: 0),
``--images-per-prompt`` its ``eval.images_per_prompt``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from ..infra import config_loader as configuration
from ..infra.checkpoint import list_checkpoints, load_file, read_checkpoint, shard_names
from ..infra.shards import read_whole
from ..infra.prompt_sets import read_prompt_set
from ..integrations.config import PipelineConfig
from .diffusers_config import TRAINER_TAG, DiffusersEvalSection
from .weights_export import EMA_DIR, export_name


def diffusers_checkpoint(spec: str | None) -> Path | None:
    """The checkpoint ``spec`` names when it is a real-model run's (a run directory: its newest ``ckpt_<n>.pt``, or
    such a file), else None (the shapes world's loaders take ``spec``). Reads the file memory-mapped, tensors and plain data only."""
    if not spec or str(spec).startswith("builtin:"):
        return None
    p = Path(spec)
    if p.is_dir():
        found = list_checkpoints(p / "checkpoints")
        p = found[-1] if found else None
    if p is None or not p.is_file() or p.suffix != ".pt":
        return None
    try:
        state = load_file(p, mmap=True)
    except Exception:      # not a checkpoint the trainers wrote (or one refused unread): the shapes loader names it
        return None
    return p if isinstance(state, dict) and state.get("trainer") == TRAINER_TAG else None


@dataclass
class TrainedRun:
    """A real-model checkpoint loaded for sampling: the saved ``config`` (a mapping), its ``pipeline`` section,
    the ``policy`` with the trained weights, which weights (``"EMA"`` or ``"trained"``) and the ``checkpoint``."""

    config: dict
    pipeline: PipelineConfig
    policy: object
    weights: str
    checkpoint: Path


def _pipeline(saved: dict, args) -> PipelineConfig:
    section = dict(saved["pipeline"])
    section.setdefault("sigma_grid", "dance")                 # a run from before the key sampled on DanceGRPO's grid
    if args.guidance_scale is not None:
        section["cfg_scale"] = args.guidance_scale
    if args.shift is not None:
        section["shift"] = args.shift
    return configuration.from_dict(PipelineConfig, section, "the checkpoint's pipeline")


def load_trained(path: Path, args) -> TrainedRun:
    """The run of checkpoint ``path`` with its trained weights (module docstring); ``args``: the command's options
    (``raw_weights``, ``guidance_scale``, ``shift``)."""
    from ..integrations.policy import load_model
    from .run_header import loaded_quietly

    state = read_checkpoint(path)
    saved = state["config"]
    pipeline = _pipeline(saved, args)
    shards = path.parent / state["model"] if isinstance(state["model"], str) else None    # FSDP's, with the EMA's
    ema = (state.get("ema") is not None or (shards is not None and bool(shard_names(shards, "ema")))) \
        and not args.raw_weights
    if pipeline.lora.enabled:
        adapter = path.parent / export_name(True, state["iteration"])
        adapter = adapter / EMA_DIR if ema else adapter
        if not adapter.is_dir():
            raise FileNotFoundError(f"the LoRA adapter of {path.name} is not at {adapter}; the run exports it beside "
                                    "each checkpoint (was it moved?)")
        pipeline = dataclasses.replace(pipeline, lora=dataclasses.replace(pipeline.lora, path=str(adapter)))
    policy = loaded_quietly(lambda: load_model(pipeline))    # its note on stderr: `jagg eval` prints JSON on stdout
    if not pipeline.lora.enabled:
        if shards is not None:                # the shards read whole, on this one process
            weights = read_whole(shards, "ema" if ema else "model", policy.named_params)
        else:
            weights = state["ema"] if ema else state["model"]
        with torch.no_grad():
            for n, p in policy.named_params.items():
                p.copy_(weights[n].to(p.device, p.dtype))
    return TrainedRun(saved, pipeline, policy, "EMA" if ema else "trained", path)


def _prompts(args) -> tuple[list[str], list | None]:
    prompts, metadata = list(args.prompt or []), None
    if args.prompt_file is not None:
        prompt_set = read_prompt_set(args.prompt_file, "--prompt-file")
        prompts += prompt_set.prompts
        if prompt_set.metadata is not None and not args.prompt:
            metadata = prompt_set.metadata
    return prompts, metadata


def sample_run(path: Path, args) -> int:
    """``jagg sample`` on a real-model run: a grid of ``--num-per-prompt`` images per prompt, one row each."""
    from ..infra.metrics import save_grid
    from .diffusers_eval import eval_noise, sample_images

    prompts, _ = _prompts(args)
    if not prompts:
        raise ValueError("give at least one --prompt or a --prompt-file")
    out = Path(args.out)
    run = load_trained(path, args)
    if run.pipeline.video != (out.suffix.lower() == ".gif"):
        raise ValueError(f"--out {out}: a {run.pipeline.family} run's grid is "
                         f"{'an animated .gif' if run.pipeline.video else 'an image, not a .gif'}")
    batch = [p for p in prompts for _ in range(args.num_per_prompt)]
    steps = args.steps or run.pipeline.eval_num_steps
    noise = eval_noise(len(batch), run.policy.latent_shape, args.seed or 0)
    images = sample_images(run.policy, batch, noise, steps, 8)
    save_grid(images, out, ncol=args.num_per_prompt, scale=1, prompts=batch)
    print(f"wrote {out} and its captions {out.with_suffix('.txt')} ({len(batch)} images of {path} with its "
          f"{run.weights} weights, {steps} ODE steps, one row per prompt)")
    return 0


def eval_run(path: Path, args) -> dict:
    """``jagg eval`` on a real-model run: the metrics of its test set (or ``--prompt-file``) with its reward (or
    ``--reward``), as its trainer evaluates."""
    from ..rewards.client import RewardClient
    from ..rewards.registry import get_reward
    from .diffusers_eval import evaluate_policy
    from .load_checks import check_reward_server

    saved = read_checkpoint(path)["config"]
    section = {k: v for k, v in (saved.get("eval") or {}).items() if k in {f.name for f in
                                                                           dataclasses.fields(DiffusersEvalSection)}}
    ev = configuration.from_dict(DiffusersEvalSection, section, "the checkpoint's eval")
    if args.images_per_prompt is not None:
        ev.images_per_prompt = args.images_per_prompt
    ev.num_prompts = args.num_prompts or 0
    if args.prompt_file is not None:
        ev.prompts_file = args.prompt_file
    ev.resolve(saved["sample"].get("prompts_file") if args.prompt_file is None else None)
    if ev.test_set is None:
        raise ValueError(f"the run of {path} has no test set (eval.prompts_file, or test.txt / test_metadata.jsonl "
                         "beside its training prompts); give one with --prompt-file")
    if args.reward is not None:
        reward = get_reward(args.reward)
    elif saved.get("reward_server"):
        client = configuration.from_dict(RewardClient, saved["reward_server"], "the checkpoint's reward_server")
        check_reward_server(client)
        reward = get_reward(client)
    else:
        reward = get_reward(saved["reward"]["weights"] or saved["reward"]["name"])
    run = load_trained(path, args)
    prompts, metadata = ev.prompts()
    result = evaluate_policy(run.policy, reward, prompts, metadata, args.steps or run.pipeline.eval_num_steps,
                             ev.seed if args.seed is None else args.seed, 8, 0)
    return {"checkpoint": str(path), "weights": run.weights, "prompts_file": ev.test_set.path,
            "num_prompts": len(prompts) // ev.images_per_prompt, "images_per_prompt": ev.images_per_prompt,
            **result.metrics}
