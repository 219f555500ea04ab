"""Rewards: a registry of reward specs (names with options, weighted sums, ``module:function``), DDPO's JPEG rewards,
the preference models (CLIP score, PickScore, HPSv2, the LAION aesthetic predictor: :mod:`jagg.rewards.preference`),
and the HTTP reward client (:class:`RewardClient`, in :mod:`jagg.rewards.client`; the server is
:mod:`jagg.rewards.server`, their wire format :mod:`jagg.rewards.protocol`). Nothing here depends on a task: the shapes
world's GenEval-like reward lives with its task (:mod:`jagg.shapes.geneval`), which registers it as ``geneval`` when
imported. The preference models import transformers only when one is built."""

from .client import RewardClient, RewardServerError
from .preference import AestheticReward, ClipScoreReward, HPSv2Reward, PickScoreReward, open_clip_to_transformers
from .registry import (REWARDS, CheckedReward, WeightedSum, available_rewards, build_reward, get_reward,
                       jpeg_compressibility, jpeg_incompressibility, jpeg_size_kb, parse_spec, register_reward)

__all__ = [
    "REWARDS", "AestheticReward", "CheckedReward", "ClipScoreReward", "HPSv2Reward", "PickScoreReward", "RewardClient",
    "RewardServerError", "WeightedSum", "available_rewards", "build_reward", "get_reward", "jpeg_compressibility",
    "jpeg_incompressibility", "jpeg_size_kb", "open_clip_to_transformers", "parse_spec", "register_reward",
]
