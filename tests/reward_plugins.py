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
