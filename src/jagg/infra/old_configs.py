"""What a config or a checkpoint written by an earlier jagg needs to load, in one place: config keys renamed, retired
or added since, and values retired since.

A config file or ``--set`` with an old key name is refused naming the new one, and a retired value with what to give
instead (:func:`refuse_old_names`, which :func:`jagg.infra.config_loader.from_dict` calls once per mapping); a
checkpoint's saved config is read as today's keys before ``--resume`` compares it with the current config
(:func:`upgrade_saved_config`, which :func:`jagg.trainers.resume.check_resumable` calls). Keys are dotted, as a trainer
config nests them (``estimator.meter_every``).
"""

from __future__ import annotations

from ..estimator_config import EstimatorConfig

# renamed keys (old name -> new name): a config with the old name is refused naming the new one; a saved config with
# the old name resumes under the new one
RENAMED_KEYS = {"estimator.audit_every": "estimator.meter_every", "estimator.audit_samples": "estimator.meter_samples",
                "estimator.correction_rates": "estimator.correction_probs"}
# retired estimator options, with the value that meant "off": a saved config holding that value ran as today's code
# runs it, so the key is dropped; any other value was an estimator that no longer exists
RETIRED_KEYS = {"estimator.control_variate": 0.0, "estimator.correction": "interval",
                "estimator.correction_intervals": 0, "estimator.score": "cosine"}
# retired values of kept keys, each with what to give instead: refused in a config, and a checkpoint trained with one
# cannot be continued
RETIRED_VALUES = {"estimator.correction_p": {
    "auto": "was retired (the probability the meter chose learned 12-15% less than the best fixed one in 2 of 3 "
            "regimes); give a fixed probability in [0, 1] instead, e.g. 0 (plain JAGG) or 0.25, chosen with jagg "
            "bench meter"}}
# keys added after checkpoints (and bench results) were written with configs that lack them: a saved config without
# one ran as this value, so it reads as that value (a key the current config lacks is not filled in)
ADDED_KEYS = {"optim.lr_schedule": "constant", "optim.warmup_steps": 0, "eval.dense_iterations": 0,
              "eval.dense_every": 0, "pipeline.sigma_grid": "dance",
              **{f"estimator.{k}": v for k, v in EstimatorConfig().to_dict().items()
                 if k == "candidates" or k.startswith("preflight_")}}


def refuse_old_names(data: dict, where: str = "") -> None:
    """Refuse, in the (nested) config mapping ``data`` of the section ``where``, an old key name, naming the new one,
    and a retired value, saying what to give instead; one pass over the whole mapping, before it is built."""
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if path in RENAMED_KEYS:
            new = RENAMED_KEYS[path]
            raise ValueError(f"config key {path!r} was renamed {new.rsplit('.', 1)[-1]!r}: write {new}: {value!r} "
                             "instead")
        why = retired_value(path, value)
        if why is not None:
            raise ValueError(f"{path}: {value!r} {why}")
        if isinstance(value, dict):
            refuse_old_names(value, path)


def retired_value(path: str, value) -> str | None:
    """What to do instead when ``value`` of the dotted config key ``path`` was retired (a sentence that starts
    "was retired"), else None."""
    return RETIRED_VALUES.get(path, {}).get(value) if isinstance(value, str) else None


def upgrade_saved_config(saved: dict, current: dict) -> dict:
    """A checkpoint's flattened config ``saved`` read as today's keys, against the flattened ``current``: old names
    renamed, keys added since filled in where ``current`` has them, retired keys at their "off" value dropped. A
    retired key at another value, or a retired value, is a ValueError saying to start a new run."""
    a = dict(saved)
    for old, new in RENAMED_KEYS.items():
        if old in a and new not in a:
            a[new] = a.pop(old)
    for key, default in ADDED_KEYS.items():
        if key in current:
            a.setdefault(key, default)
    for key, off in RETIRED_KEYS.items():
        if key in a and key not in current:
            if a.pop(key) != off:
                raise ValueError(f"cannot resume: the checkpoint was trained with {key}, an option since retired; "
                                 "start a new run in another directory")
    for key in RETIRED_VALUES:
        why = retired_value(key, a.get(key))
        if why is not None:
            raise ValueError(f"cannot resume: the checkpoint was trained with {key} {a[key]!r}, which {why}, and start "
                             "a new run in another directory")
    return a
