"""User rewards (module:function) used by the reliability tests."""

from jagg.shapes.geneval import GenevalReward

CALLS = 0
FAIL_AT = -1  # the call number that raises; -1 = never


def flaky_geneval(images, prompts, metadata):
    global CALLS
    CALLS += 1
    if CALLS == FAIL_AT:
        raise ConnectionError("reward server went away")
    return GenevalReward()(images, prompts, metadata)


def brightness(images, prompts, metadata):
    """Mean pixel value in [0, 1]: smooth and prompt-independent, so its policy gradient has a clear signal."""
    import numpy as np

    from jagg.rewards.images import to_uint8

    return to_uint8(images).reshape(len(prompts), -1).mean(1).astype(np.float32) / 255.0


def coin(images, prompts, metadata):
    """A reward that ignores what the image shows (a hash of its bytes): no signal to learn."""
    import zlib

    import numpy as np

    from jagg.rewards.images import to_uint8

    return np.array([zlib.crc32(im.tobytes()) % 1000 / 1000 for im in to_uint8(images)], dtype=np.float32)


def constant(images, prompts, metadata):
    """A reward that gives every image the same score: no prompt group has any spread, so GRPO trains nothing."""
    import numpy as np

    return np.full(len(prompts), 0.5, dtype=np.float32)


SIGINT_AT = -1  # the call number during which the process sends itself SIGINT; -1 = never


def sigint_at(images, prompts, metadata):
    """``jpeg_compressibility``, sending this process SIGINT (Ctrl-C) during call ``SIGINT_AT``."""
    import os
    import signal

    from jagg.rewards.registry import jpeg_compressibility

    global CALLS
    CALLS += 1
    if CALLS == SIGINT_AT:
        os.kill(os.getpid(), signal.SIGINT)
    return jpeg_compressibility(images, prompts, metadata)
