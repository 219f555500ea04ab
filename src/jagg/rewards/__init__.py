"""Rewards: a registry of reward specs (names with options, weighted sums, ``module:function``), DDPO's JPEG rewards,
the preference models (CLIP score, PickScore, HPSv2, the LAION aesthetic predictor: :mod:`jagg.rewards.preference`),
the rewards Flow-GRPO users run (:class:`FlowGrpoRemote` for its GenEval, DeQA and UnifiedReward servers, the
VLM judge :class:`VlmJudge` on an OpenAI-compatible endpoint, the OCR reward :class:`OcrReward`), and the HTTP reward
client (:class:`RewardClient`, in :mod:`jagg.rewards.client`; the server is
:mod:`jagg.rewards.server`, their wire format :mod:`jagg.rewards.protocol`). Nothing here depends on a task: the shapes
world's GenEval-like reward lives with its task (:mod:`jagg.shapes.geneval`), which registers it as ``geneval`` when
imported. The preference models import transformers only when one is built."""

from .client import RewardClient, RewardServerError
from .flow_grpo import FlowGrpoRemote
from .ocr import OcrReward
from .preference import AestheticReward, ClipScoreReward, HPSv2Reward, PickScoreReward, open_clip_to_transformers
from .registry import (REWARDS, CheckedReward, WeightedSum, available_rewards, build_reward, get_reward,
                       jpeg_compressibility, jpeg_incompressibility, jpeg_size_kb, parse_spec, register_reward)
from .vlm_judge import VlmJudge

__all__ = [
    "REWARDS", "AestheticReward", "CheckedReward", "ClipScoreReward", "FlowGrpoRemote", "HPSv2Reward", "OcrReward",
    "PickScoreReward", "RewardClient", "RewardServerError", "VlmJudge", "WeightedSum", "available_rewards",
    "build_reward", "get_reward", "jpeg_compressibility", "jpeg_incompressibility", "jpeg_size_kb",
    "open_clip_to_transformers", "parse_spec", "register_reward",
]
