"""User rewards (module:function) used by the reliability tests."""

from jagg.rewards import GenevalReward

CALLS = 0
FAIL_AT = -1  # the call number that raises; -1 = never


def flaky_geneval(images, prompts, metadata):
    global CALLS
    CALLS += 1
    if CALLS == FAIL_AT:
        raise ConnectionError("reward server went away")
    return GenevalReward()(images, prompts, metadata)
