"""The config keys a lab tool sets itself, per regime, variant or run: a ``--set`` of one of them would either
overwrite what the tool varies (every row the same measurement under different labels) or be overwritten by it (the
user's setting silently dropped), so it is refused, naming the key and the option that chooses it."""

from __future__ import annotations

OVERWRITES = "overwrite what it varies, and every row would be the same measurement under another row's label"
OVERWRITTEN = "be overwritten by it, silently"


def refuse_fixed_keys(sets: list[str] | None, keys: dict[str, str], tool: str, effect: str) -> None:
    """Raise a ValueError for the first ``--set KEY=VALUE`` of ``sets`` whose key is one of ``keys`` (key -> what
    sets it, e.g. ``"its regimes (--steps, --sde, --no-cuts)"``), a section holding one (``--set sample={eta: 0.5}``)
    or a key inside one; ``effect`` says what the ``--set`` would do (:data:`OVERWRITES`, :data:`OVERWRITTEN`)."""
    for item in sets or []:
        key = item.split("=", 1)[0].strip()
        hit = next((k for k in keys if k == key or k.startswith(key + ".") or key.startswith(k + ".")), None)
        if hit is not None:
            raise ValueError(f"--set {item}: {tool} sets {hit} itself, from {keys[hit]}; this --set would {effect}. "
                             "Leave it out")
