"""The embedded task: the "shapes" world, a procedural text-to-image task with a verifiable GenEval-like reward
(docs/world.md), its TinyDiT and guided velocity, pretraining and evaluation (its GRPO trainer, the main job's, is
:mod:`jagg.trainers.shapes_trainer`).

Importing this package loads the world only (scene grammar, renderer, tokenizer) and registers its reward as
``geneval`` (:mod:`jagg.rewards.registry`); the other modules load on demand:
``scene``, ``render``, ``tokenizer`` (the world), ``data`` (pretraining batches), ``dit`` and ``guided_velocity`` (the
model and its classifier-free-guided velocity callable), ``weights`` (the shipped checkpoint and checkpoint loading),
``geneval`` (the reward), ``pretrain``, ``evaluation``."""

from . import geneval, tokenizer          # geneval registers the reward 'geneval'
from ..rewards.images import from_tensor, to_tensor, to_uint8
from .render import render, render_batch, render_prompts
from .scene import (BACKGROUND, CATEGORIES, COLORS, HELD_OUT_PAIRS, RELATIONS, SHAPES, VOCAB, ObjectSpec,
                    PromptSpec, Scene, SceneObject, all_prompts, parse_prompt, sample_scene, test_prompts,
                    train_prompts, uses_held_out)

__all__ = [
    "BACKGROUND", "CATEGORIES", "COLORS", "HELD_OUT_PAIRS", "RELATIONS", "SHAPES", "VOCAB", "ObjectSpec",
    "PromptSpec", "Scene", "SceneObject", "all_prompts", "from_tensor", "parse_prompt", "render", "render_batch",
    "render_prompts", "sample_scene", "test_prompts", "to_tensor", "to_uint8", "tokenizer", "train_prompts",
    "uses_held_out",
]
