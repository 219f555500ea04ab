"""Rewards: a registry of reward specs (names, weighted sums, ``module:function``), DDPO's JPEG rewards, and the
HTTP reward client (:class:`RewardClient`, in :mod:`jagg.rewards.client`; the server is :mod:`jagg.rewards.server`,
their wire format :mod:`jagg.rewards.protocol`). Nothing here depends on a task: the shapes world's GenEval-like
reward lives with its task (:mod:`jagg.shapes.geneval`), which registers it as ``geneval`` when imported."""

from .client import RewardClient, RewardServerError
from .registry import (REWARDS, CheckedReward, WeightedSum, available_rewards, get_reward, jpeg_compressibility,
                       jpeg_incompressibility, jpeg_size_kb, register_reward)

__all__ = [
    "REWARDS", "CheckedReward", "RewardClient", "RewardServerError", "WeightedSum", "available_rewards",
    "get_reward", "jpeg_compressibility", "jpeg_incompressibility", "jpeg_size_kb", "register_reward",
]
