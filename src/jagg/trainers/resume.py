"""Whether a checkpoint's run may continue under the current config: :func:`check_resumable` compares the saved
config with the current one key by key (an earlier jagg's keys read as today's,
:func:`jagg.infra.old_configs.upgrade_saved_config`) and refuses a change that would break continuation, naming the
key; :data:`RESUMABLE_CHANGES` are the keys both trainers let change (the diffusers trainer adds its own). The
learning-rate schedule's own check is :func:`jagg.trainers.lr_schedule.check_resumable_schedule`.
"""

from __future__ import annotations

from ..infra.old_configs import upgrade_saved_config

# config keys that may change between a checkpoint and its resumption (the aborts' limits change no gradient)
RESUMABLE_CHANGES = ("grpo.iterations", "grpo.max_consecutive_skips", "grpo.max_empty_iterations", "log.", "eval.",
                     "threads")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "weights":
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _may_change(key: str, allowed: tuple[str, ...]) -> bool:
    """Whether ``key`` is one of ``allowed``: a key, a section (``"log."``) or a key with sub-keys (``"reward_server"``)."""
    return any(key.startswith(a) if a.endswith(".") else key == a or key.startswith(a + ".") for a in allowed)


_ABSENT = object()


def _shown(value) -> str:
    if value is _ABSENT:
        return "(absent)"
    return "null" if value is None else repr(value) if isinstance(value, str) else str(value)


def check_resumable(saved: dict, current: dict, allowed: tuple[str, ...] = RESUMABLE_CHANGES) -> list[str]:
    """Raise a ValueError naming the first config key whose change would break continuation; return one line per
    key that changed and may (``allowed``), e.g. ``"grpo.iterations: 30 in the checkpoint, 200 now"``."""
    b = _flatten(current)
    a = upgrade_saved_config(_flatten(saved), b)          # an older jagg's keys read as today's (infra.old_configs)
    changed = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key):
            continue
        if not _may_change(key, allowed):
            raise ValueError(f"cannot resume: config key {key!r} was {a.get(key)!r} in the checkpoint but is "
                             f"{b.get(key)!r} now; use the checkpoint's value, or start a new run in another directory")
        changed.append(f"{key}: {_shown(a.get(key, _ABSENT))} in the checkpoint, {_shown(b.get(key, _ABSENT))} now")
    return changed

