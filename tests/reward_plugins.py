"""User rewards (``module:function``) the tests name in their configs and commands, in this process or in the
processes they launch: rewards with a clear signal, with none or with no spread, one that fails, one that signals its
own process mid-run, rewards that zero one prompt's group, a video reward, the reward server's echo, and an OCR
engine that reads text written into pixels."""

import os
import signal
import time

import numpy as np

from jagg.rewards.images import to_uint8
from jagg.rewards.registry import jpeg_compressibility
from jagg.shapes.geneval import GenevalReward

CALLS = 0
FAIL_AT = -1  # the call number that raises; -1 = never
SIGINT_AT = -1  # the call number during which the process sends itself SIGINT; -1 = never
SIGTERM_AT = -1  # the call number during which the process sends itself SIGTERM; -1 = never


def flaky_geneval(images, prompts, metadata):
    global CALLS
    CALLS += 1
    if CALLS == FAIL_AT:
        raise ConnectionError("reward server went away")
    return GenevalReward()(images, prompts, metadata)


def brightness(images, prompts, metadata):
    """Mean pixel value in [0, 1]: smooth and prompt-independent, so its policy gradient has a clear signal."""
    return to_uint8(images).reshape(len(prompts), -1).mean(1).astype(np.float32) / 255.0


def coin(images, prompts, metadata):
    """A reward that ignores what the image shows (a hash of its bytes): no signal to learn."""
    import zlib

    return np.array([zlib.crc32(im.tobytes()) % 1000 / 1000 for im in to_uint8(images)], dtype=np.float32)


def constant(images, prompts, metadata):
    """A reward that gives every image the same score: no prompt group has any spread, so GRPO trains nothing."""
    return np.full(len(prompts), 0.5, dtype=np.float32)


def _signalling(images, prompts, metadata, sig: int, at: int):
    """``jpeg_compressibility``, sending this process ``sig`` during call ``at`` (counted in ``CALLS``)."""
    global CALLS
    CALLS += 1
    if CALLS == at:
        os.kill(os.getpid(), sig)
    return jpeg_compressibility(images, prompts, metadata)


def sigint_at(images, prompts, metadata):
    """``jpeg_compressibility``, sending this process SIGINT (Ctrl-C) during call ``SIGINT_AT``."""
    return _signalling(images, prompts, metadata, signal.SIGINT, SIGINT_AT)


def sigterm_at(images, prompts, metadata):
    """``jpeg_compressibility``, sending this process SIGTERM during call ``SIGTERM_AT``."""
    return _signalling(images, prompts, metadata, signal.SIGTERM, SIGTERM_AT)


def red_is_dark(images, prompts, metadata):
    """Brightness, but 0 for 'a red cube': that prompt's group has zero spread (dropped with grpo.drop_zero_spread)."""
    return np.where([p == "a red cube" for p in prompts], 0.0, brightness(images, prompts, metadata)).astype(np.float32)


def blue_is_dark(images, prompts, metadata):
    """Brightness, but 0 for 'a blue ball' (the other prompt group of red_is_dark's two drops out)."""
    return np.where([p == "a blue ball" for p in prompts], 0.0, brightness(images, prompts, metadata)).astype(np.float32)


def video_brightness(images, prompts, metadata):
    """A video reward: it gets the videos uint8 [N, F, H, W, 3] themselves."""
    assert images.ndim == 5 and images.shape[-1] == 3 and len(prompts) == len(images)
    return images.reshape(len(images), -1).mean(1).astype(np.float32) / 255


def echo_reward(images, prompts, metadata=None):
    """The reward server's test reward: mean brightness + prompt length; sleeps on 'sleep', fails on 'fail', NaN on
    'nan'; its info echoes each prompt's length and metadata tag, and the batch size."""
    if any("fail" in p for p in prompts):
        raise ValueError("this prompt always fails")
    if any("sleep" in p for p in prompts):
        time.sleep(1.0)
    scores = images.reshape(len(images), -1).mean(1) / 255.0 + np.array([len(p) for p in prompts])
    scores[[i for i, p in enumerate(prompts) if "nan" in p]] = np.nan
    info = {"n_chars": [len(p) for p in prompts], "tag": [m.get("tag") if m else None for m in (metadata or
                                                                                              [None] * len(prompts))],
            "batch": len(prompts)}
    return scores.astype(np.float32), info


def ocr_pixels(lines: list[tuple[str, int]], side: int = 16) -> np.ndarray:
    """An image that :class:`StubOcr` reads as ``lines`` (text, confidence 0 or 1): line k's characters in the red
    channel of pixel row k, its confidence in the green channel of that row's first pixel."""
    im = np.zeros((side, side, 3), np.uint8)
    for k, (text, confidence) in enumerate(lines):
        im[k, :len(text), 0] = np.frombuffer(text.encode("latin1"), np.uint8)
        im[k, 0, 1] = confidence
    return im


class StubOcr:
    """An OCR engine for tests (the ocr reward's ``engine=reward_plugins:StubOcr``): reads what :func:`ocr_pixels`
    wrote; an image whose last pixel is (1, 2, 3) makes it raise."""

    def __call__(self, image):
        if image[-1, -1].tolist() == [1, 2, 3]:
            raise RuntimeError("engine crashed")
        lines = []
        for row in image:
            zeros = np.flatnonzero(row[:, 0] == 0)
            codes = row[: zeros[0] if zeros.size else len(row), 0]
            if codes.size:
                lines.append((codes.tobytes().decode("latin1"), float(row[0, 1])))
        return lines
