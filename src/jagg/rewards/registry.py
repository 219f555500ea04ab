"""Reward registry: turn a reward spec from a config into one checked callable.

Every reward has the signature

    reward(images, prompts: list[str], metadata: list[dict] | None) -> (scores float32 [N], info: dict)

with images uint8 [N, H, W, 3] or a float tensor [N, 3, H, W] in [-1, 1]. `get_reward(spec)` accepts
  - a registered name: "jpeg_compressibility", "jpeg_incompressibility", the preference models "clip_score",
    "pickscore", "hpsv2", "aesthetic" (:mod:`jagg.rewards.preference`), the rewards Flow-GRPO users run:
    "flow_grpo_remote" (a GenEval, DeQA or UnifiedReward server, :mod:`jagg.rewards.flow_grpo`), "vlm_judge" (a VLM
    judge on an OpenAI-compatible endpoint, :mod:`jagg.rewards.vlm_judge`) and "ocr" (:mod:`jagg.rewards.ocr`), and
    what packages register with `register_reward` when they are imported (`jagg.shapes` registers its GenEval-like
    "geneval");
  - a registered name with options, "name:key=value,key=value" (e.g. "pickscore:path=/models/PickScore_v1,
    batch_size=16"): keyword arguments of the name's factory; a value is converted to the type of the factory's
    default for that keyword (int, float, bool), and may not contain a comma;
  - a dict of weights, e.g. {"geneval": 1.0, "jpeg_compressibility": 0.1} (keys may carry options): the weighted sum,
    with each component's scores in info["scores/<name>"] and its info under "<name>/<key>" (the name without its
    options);
  - "package.module:attribute", a user function (or a class, instantiated with no arguments) that
    returns (scores, info) or just scores;
  - a callable with that signature.
`defaults` (the trainer's device and dtype) go to every factory that takes them, unless the spec sets them.
The returned callable checks what every reward gives back: one finite score per image.

Videos (a video family such as Wan decodes uint8 ``[N, F, H, W, 3]``): a registered reward and a reward server score
images, so each video is scored frame by frame and its score is the mean over its F frames (:func:`frame_mean`; so
is each info entry with one number per frame); a ``package.module:function`` (or a callable) gets the videos
``[N, F, H, W, 3]`` themselves, to score them as it likes. In a weighted sum each component follows its own rule.
"""

from __future__ import annotations

import inspect
import io
import itertools
import math
import numbers
from typing import Callable

import numpy as np
import torch
from PIL import Image

from .. import checks
from ..checks import FLOAT32_MAX, check_float32, shown
from .flow_grpo import FlowGrpoRemote
from .images import to_uint8
from .ocr import OcrReward
from .preference import AestheticReward, ClipScoreReward, HPSv2Reward, PickScoreReward
from .user_code import instantiated, resolve
from .vlm_judge import VlmJudge

RewardFn = Callable[..., "tuple[np.ndarray, dict] | np.ndarray"]


def jpeg_size_kb(images) -> np.ndarray:
    """JPEG size (quality 95, as DDPO) of each image in kB: images as above -> float32 [N]."""
    out = []
    for img in to_uint8(images):
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=95)
        out.append(buf.tell() / 1000)
    return np.array(out, dtype=np.float32)


def jpeg_compressibility(images, prompts, metadata=None):
    """DDPO's compressibility reward: minus the JPEG size in kB."""
    kb = jpeg_size_kb(images)
    return -kb, {"jpeg_kb": kb}


def jpeg_incompressibility(images, prompts, metadata=None):
    """DDPO's incompressibility reward: the JPEG size in kB."""
    kb = jpeg_size_kb(images)
    return kb, {"jpeg_kb": kb}


REWARDS: dict[str, Callable[..., RewardFn]] = {  # name -> factory(**options)
    "jpeg_compressibility": lambda: jpeg_compressibility,
    "jpeg_incompressibility": lambda: jpeg_incompressibility,
    "clip_score": ClipScoreReward,
    "pickscore": PickScoreReward,
    "hpsv2": HPSv2Reward,
    "aesthetic": AestheticReward,
    "flow_grpo_remote": FlowGrpoRemote,
    "vlm_judge": VlmJudge,
    "ocr": OcrReward,
}


def register_reward(name: str, factory: Callable[..., RewardFn]) -> None:
    """Make `get_reward(name)` (and `get_reward("name:key=value")`) return the checked `factory(**options)`."""
    if name in REWARDS:
        raise ValueError(f"reward {name!r} is already registered")
    if not name or any(c in name for c in ":,= "):
        raise ValueError(f"reward name {name!r} must be non-empty without ':', ',', '=' or spaces")
    REWARDS[name] = factory


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"name"`` or ``"name:key=value,key=value"`` -> ``(name, {key: value})`` (:func:`jagg.checks.parse_spec`, the
    one spec parser: a malformed option, or one given twice, is a ValueError naming the reward)."""
    return checks.parse_spec(spec, "reward", "path=/models/x,batch_size=16")


def registered_name(spec: str) -> str | None:
    """The registered name ``spec`` starts with (``"pickscore"`` for ``"pickscore:path=..."``), or None (a
    ``module:function`` or an unknown name)."""
    name = spec.partition(":")[0]
    return name if name in REWARDS else None


def _option(name: str, param: inspect.Parameter, value):
    """An option value from a spec string, converted to the type of the factory's default (int, float, bool)."""
    kind = type(param.default)
    if not isinstance(value, str) or param.default is inspect.Parameter.empty or kind not in (bool, int, float):
        return value
    if kind is bool:
        if value.lower() not in ("true", "false"):
            raise ValueError(f"reward {name!r}: option {param.name} must be true or false; got {value!r}")
        return value.lower() == "true"
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"reward {name!r}: option {param.name} must be {'an integer' if kind is int else 'a number'}"
                         f"; got {value!r}") from None


def _factory_call(name: str, options: dict, defaults: dict | None) -> tuple[Callable[..., RewardFn], dict]:
    """The factory of the registered ``name`` and its checked keyword arguments (see :func:`build_reward`)."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; available: {', '.join(available_rewards())}")
    factory = REWARDS[name]
    params = {k: p for k, p in inspect.signature(factory).parameters.items()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = sorted(set(options) - set(params))
    if unknown:
        raise ValueError(f"reward {name!r}: unknown option(s) {unknown}; its options: "
                         f"{', '.join(params) if params else 'none'}")
    kwargs = {k: v for k, v in (defaults or {}).items() if k in params}
    kwargs.update({k: _option(name, params[k], v) for k, v in options.items()})
    return factory, kwargs


def build_reward(name: str, options: dict | None = None, defaults: dict | None = None) -> RewardFn:
    """The unchecked reward callable of the registered ``name``: its factory called with ``options`` (a spec's strings
    are converted to the type of the factory's default for that keyword: int, float, bool) and with each of
    ``defaults`` that it takes and ``options`` do not set. An option the factory does not take is a ValueError
    naming the ones it does."""
    factory, kwargs = _factory_call(name, dict(options or {}), defaults)
    return factory(**kwargs)


def check_spec(spec: str | dict) -> None:
    """Check a reward spec without building the reward, so that a config is refused at load, not when training
    starts: a dict of weights is non-empty, each weight a number that fits float32 and each name once; every name is
    registered (its options well formed, taken by its factory and of the right type) or a
    ``package.module:attribute`` that imports and is callable. A ValueError says what is wrong."""
    if isinstance(spec, dict):
        _check_weights(spec)
    for one in (spec if isinstance(spec, dict) else [spec]):
        if not isinstance(one, str):
            raise ValueError(f"a reward name must be a string; got {one!r}")
        if registered_name(one):
            factory, kwargs = _factory_call(*parse_spec(one), None)
            if hasattr(factory, "check_options"):           # e.g. a preference model's paths and batch_size
                try:
                    factory.check_options(kwargs)
                except ValueError as e:
                    raise ValueError(f"reward {one!r}: {e}") from None
        elif ":" in one:
            _resolve(one)
        else:
            raise _unknown(one)


def _check_weights(weights: dict) -> None:
    """Raise unless ``weights`` (name -> weight) is non-empty, every weight a finite number that fits float32, and no
    registered name appears twice (with different options)."""
    if not weights:
        raise ValueError("empty reward weights; give e.g. {'geneval': 1.0}")
    seen = set()
    for name, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"weight of reward {name!r} must be a finite number, got {w!r}")
        check_float32(float(w), f"weight of reward {name!r}")
        key = registered_name(str(name)) or name
        if key in seen:
            raise ValueError(f"reward {key!r} appears twice in the weights {list(weights)}; give each once")
        seen.add(key)


def _unknown(spec: str) -> ValueError:
    return ValueError(f"unknown reward {spec!r}; available: {', '.join(available_rewards())} (options as "
                      "'name:key=value,...'), a dict of weights, or 'package.module:function' (a package's own "
                      "rewards are registered when it is imported: import jagg.shapes registers 'geneval')")


class RewardError(ValueError):
    """A reward function failed on a batch; the message names the reward and the batch."""


def frame_mean(fn: RewardFn, videos, prompts: list[str], metadata: list[dict] | None = None) -> tuple[np.ndarray, dict]:
    """Score uint8 videos ``[N, F, H, W, 3]`` (numpy or torch) with the image reward ``fn``: its ``N F`` frames in one
    call (each with its video's prompt and metadata), the scores averaged over each video's F frames -> float32
    ``[N]``; an info entry with one number per frame is averaged the same way, any other is passed on."""
    v = videos.detach().cpu().numpy() if isinstance(videos, torch.Tensor) else np.asarray(videos)
    n, f = v.shape[:2]
    each = (lambda seq: None if seq is None else [x for x in seq for _ in range(f)])
    out = fn(v.reshape(n * f, *v.shape[2:]), each(prompts), each(metadata))
    scores, info = out if isinstance(out, tuple) else (out, {})
    if isinstance(scores, torch.Tensor):
        scores = scores.detach().float().cpu().numpy()
    scores = np.asarray(scores, dtype=np.float32)
    if scores.shape != (n * f,):
        raise ValueError(f"returned scores of shape {scores.shape} for {n} videos of {f} frames; an image reward "
                         f"scores every frame, shape ({n * f},)")

    def per_video(value):
        a = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
        if isinstance(a, (np.ndarray, list)) and np.ndim(a) >= 1 and len(a) == n * f:
            a = np.asarray(a)
            if np.issubdtype(a.dtype, np.number):
                return a.reshape(n, f, *a.shape[1:]).mean(1)
        return value
    return scores.reshape(n, f).mean(1), {k: per_video(x) for k, x in (info or {}).items()}


def is_video(images) -> bool:
    """Whether ``images`` are videos ``[N, F, H, W, 3]`` (five axes) rather than images."""
    return getattr(images, "ndim", None) == 5


class CheckedReward:
    """Wraps a reward: normalises its output to (float32 [N], dict) and raises ValueError naming the reward
    and the batch index on a wrong length, NaN or inf. ``per_frame``: videos are scored frame by frame and averaged
    (:func:`frame_mean`; an image reward); otherwise ``fn`` gets them as they are."""

    def __init__(self, name: str, fn: RewardFn, per_frame: bool = False):
        self.name, self.fn, self.per_frame = name, fn, per_frame

    def __repr__(self) -> str:
        return f"CheckedReward({self.name!r})"

    def __call__(self, images, prompts: list[str], metadata: list[dict] | None = None) -> tuple[np.ndarray, dict]:
        n = len(images)
        if len(prompts) != n:
            raise ValueError(f"reward {self.name!r}: got {n} images but {len(prompts)} prompts")
        if metadata is not None and len(metadata) != n:
            raise ValueError(f"reward {self.name!r}: got {n} images but {len(metadata)} metadata entries")
        try:
            if self.per_frame and is_video(images):
                out = frame_mean(self.fn, images, prompts, metadata)
            else:
                out = self.fn(images, prompts, metadata)
        except Exception as e:
            raise RewardError(f"reward {self.name!r} raised {type(e).__name__}: {e} (batch of {n}, first prompt "
                              f"{prompts[0] if prompts else None!r})") from e
        pair = isinstance(out, tuple) and len(out) == 2 and not isinstance(out[1], (numbers.Number, np.generic))
        scores, info = out if pair else (out, {})
        scores = as_scores(scores, n, f"reward {self.name!r}")
        if scores.shape != (n,):
            raise ValueError(f"reward {self.name!r} returned scores of shape {scores.shape} for a batch of {n}; "
                             f"it must return one score per image, shape ({n},)")
        bad = np.flatnonzero(~np.isfinite(scores))
        if bad.size:
            raise ValueError(f"reward {self.name!r} returned {scores[bad[0]]} at batch index {bad[0]} "
                             f"(prompt {prompts[bad[0]]!r}); scores must be finite")
        if not isinstance(info, dict):
            raise ValueError(f"reward {self.name!r} returned info of type {type(info).__name__}; return a dict")
        return scores, info


def as_scores(scores, n: int, who: str) -> np.ndarray:
    """A reward's returned scores as float32, coerced at the boundary or refused naming ``who``: a tensor, an array, a
    list or tuple, or a finite iterable (a generator: its first ``n + 1`` items) of real numbers (bools count as 0 and
    1); strings, complex numbers, ``None`` and other objects are a ValueError, never silently converted."""
    if isinstance(scores, torch.Tensor):
        if scores.is_complex():
            raise ValueError(f"{who} returned complex scores ({scores.dtype}); return real numbers, one per image")
        scores = scores.detach().to(torch.float64).cpu().numpy()
    elif isinstance(scores, (str, bytes, dict)) or scores is None:
        raise ValueError(f"{who} returned a {type(scores).__name__} as its scores; return {n} real numbers (a list, "
                         "array or tensor), one per image")
    elif not isinstance(scores, (np.ndarray, list, tuple, numbers.Number, np.generic)) and hasattr(scores, "__iter__"):
        scores = list(itertools.islice(iter(scores), n + 1))     # a generator: at most one too many, to report it
    try:
        raw = np.asarray(scores)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{who} returned scores numpy cannot read as an array ({_one_line(e)}); return {n} real "
                         "numbers, one per image") from None
    if raw.dtype.kind == "O":                      # mixed objects: each one must be a real number
        bad = next((v for v in raw.ravel() if not isinstance(v, numbers.Real)), None)
        if bad is not None:
            raise ValueError(f"{who} returned a score {shown(bad)} of type {type(bad).__name__}; scores must be real "
                             "numbers")
        raw = raw.astype(np.float64)
    if raw.dtype.kind == "c":
        raise ValueError(f"{who} returned complex scores ({raw.dtype}); return real numbers, one per image")
    if raw.dtype.kind not in "biuf":
        raise ValueError(f"{who} returned scores of type {raw.dtype} (e.g. {shown(raw.ravel()[0]) if raw.size else '[]'}"
                         "); scores must be real numbers, not strings or objects")
    big = np.flatnonzero(np.isfinite(raw.astype(np.float64)) & (np.abs(raw.astype(np.float64)) > FLOAT32_MAX))
    if big.size:
        raise ValueError(f"{who} returned {raw.ravel()[big[0]]!r} at batch index {big[0]}, beyond float32 (the "
                         "dtype scores are used in); scale the reward down")
    return raw.astype(np.float32)


def _one_line(e, limit: int = 200) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class WeightedSum:
    """sum_i weight_i * reward_i; component scores in info["scores/<name>"], their info under "<name>/" (the name of
    a registered spec without its options)."""

    def __init__(self, weights: dict[str, float], defaults: dict | None = None):
        _check_weights(weights)
        self.weights, self.parts = {}, {}
        for spec, w in weights.items():
            name = registered_name(spec) or spec
            self.weights[name], self.parts[name] = w, get_reward(spec, defaults)

    def __call__(self, images, prompts, metadata=None):
        total = np.zeros(len(images), dtype=np.float32)
        info: dict = {}
        for name, fn in self.parts.items():
            scores, part = fn(images, prompts, metadata)
            total += np.float32(self.weights[name]) * scores
            info[f"scores/{name}"] = scores
            info.update({f"{name}/{k}": v for k, v in part.items()})
        return total, info


USER_REWARD = ("user reward", "(images, prompts, metadata)")


def _resolve(path: str):
    """The attribute ``package.module:attribute`` names (imported, not called); a ValueError when it cannot be
    loaded or is not callable."""
    return resolve(path, *USER_REWARD)


def _import(path: str) -> RewardFn:
    """The user reward ``package.module:attribute``: a function, or a class instantiated with no arguments."""
    return instantiated(path, *USER_REWARD)


def available_rewards() -> list[str]:
    return sorted(REWARDS)


def get_reward(spec: str | dict[str, float] | RewardFn, defaults: dict | None = None) -> CheckedReward:
    """A reward spec (name, "name:key=value,...", {name: weight}, "module:function" or callable) -> checked reward
    callable. ``defaults``: options offered to every registered factory that takes them (the trainer's ``device``
    and ``dtype``); the spec's own options win."""
    if isinstance(spec, CheckedReward):
        return spec
    if isinstance(spec, dict):
        total = WeightedSum(spec, defaults)
        return CheckedReward("+".join(f"{w:g}*{n}" for n, w in spec.items()), total)
    if isinstance(spec, str):
        if registered_name(spec):
            return CheckedReward(spec, build_reward(*parse_spec(spec), defaults), per_frame=True)
        if ":" in spec:
            return CheckedReward(spec, _import(spec))
        raise _unknown(spec)
    if callable(spec):
        from .client import RewardClient                  # a reward server scores images: videos frame by frame

        return CheckedReward(getattr(spec, "__name__", type(spec).__name__), spec,
                             per_frame=isinstance(spec, RewardClient))
    raise TypeError(f"reward spec must be a name, a dict of weights, 'module:function' or a callable, got {spec!r}")
