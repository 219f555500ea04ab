"""Checks of the ``NAME:KEY=VALUE,...`` specs the command line takes (``--estimator``, ``--variant``, ``--cost``, a
reward spec): one parser (:func:`parse_spec`), which refuses a key given twice, and the checks that names given to a
repeatable option are unique."""

from __future__ import annotations


def parse_spec(spec: str, flag: str, example: str = "") -> tuple[str, dict[str, str]]:
    """``NAME`` or ``NAME:KEY=VALUE,...`` (``--estimator``, ``--variant``, ``--cost``) -> ``(name, {key: value})``,
    the items split at the commas outside brackets (``r:correction_probs=[0.4,0.1],window=5`` is two items), keys and
    values stripped, empty items skipped; an item that is not ``KEY=VALUE``, or a key given twice, is an error naming
    ``flag`` (with ``example``, options shown as a user would write them)."""
    name, _, rest = spec.partition(":")
    items, depth, cur = [], 0, ""
    for ch in rest + ",":
        depth += (ch in "[{(") - (ch in "]})")
        if ch == "," and depth <= 0:
            items.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out = {}
    for item in filter(None, items):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{flag} {spec!r}: {item!r} is not KEY=VALUE; options are KEY=VALUE separated by commas"
                             + (f", e.g. {name or 'NAME'}:{example}" if example else ""))
        if key.strip() in out:
            raise ValueError(f"{flag} {spec!r}: option {key.strip()!r} is given twice; give each once")
        out[key.strip()] = value.strip()
    return name, out


def check_unique_names(names: list[str], reserved: tuple[str, ...] | dict, flag: str) -> None:
    """Raise unless the names given to ``flag`` (``--estimator``, ``--variant``: ``NAME`` or ``NAME:KEY=VALUE,...``)
    are unique and a defined one (``NAME:...``) does not take a ``reserved`` (built-in) name: one name, one row of
    the results, never one silently replacing another."""
    seen = set()
    for spec in names:
        name, defines, _ = spec.partition(":")
        if defines and name in reserved:
            raise ValueError(f"{flag} {spec!r}: {name!r} is a built-in name ({', '.join(reserved)}); give your "
                             f"definition another name, e.g. {flag} my_{name}:{spec.partition(':')[2]}")
        if name in seen:
            raise ValueError(f"{flag} {spec!r}: the name {name!r} is given twice; give every {flag} its own name")
        seen.add(name)


def check_no_repeats(values: list[str], flag: str) -> None:
    """Raise when a value is given to ``flag`` twice (``--rewards``, ``--variants``): each would be measured twice
    under one name."""
    repeated = next((v for i, v in enumerate(values) if v in values[:i]), None)
    if repeated is not None:
        raise ValueError(f"{flag}: {repeated!r} is given twice; give each once")
