"""Rewards: the verifiable shapes-world GenEval reward, DDPO's JPEG rewards, and a registry for specs."""

from .geneval import Detection, GenevalReward
from .registry import (REWARDS, CheckedReward, WeightedSum, available_rewards, get_reward, jpeg_compressibility,
                       jpeg_incompressibility, jpeg_size_kb, register_reward)

__all__ = [
    "REWARDS", "CheckedReward", "Detection", "GenevalReward", "WeightedSum", "available_rewards", "get_reward",
    "jpeg_compressibility", "jpeg_incompressibility", "jpeg_size_kb", "register_reward",
]
