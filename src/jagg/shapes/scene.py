"""The "shapes" world: structured scenes, a prompt grammar and fixed train/test prompt splits.

A scene is a handful of flat-coloured circles, squares and upright triangles on a fixed dark background.
Prompts follow a small GenEval-like grammar (every word is in `VOCAB`):

    prompt   := object | object "and" object | object relation object
    object   := count [colour] shape          ("a red circle", "three squares", "two blue triangles")
    count    := "a" | "one" | "two" | "three" (plural shape word when the count is above one)
    relation := "to the left of" | "to the right of" | "above" | "below"

The GenEval category of a prompt follows from its structure (`PromptSpec.category`):

    single_object  "a circle"                       one object, no colour
    colors         "a red circle"                   one object with a colour
    counting       "three blue squares"             one object spec with count 2 or 3
    two_object     "a circle and a square"          two objects, no colours
    color_attr     "a red square and a blue circle" two objects, colours must bind to the right shapes
    position       "a green triangle to the left of a yellow circle"

Coordinates are fractions of the image: x to the right, y downwards, both in [0, 1].
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import asdict, dataclass

import numpy as np

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 90, 240),
    "yellow": (240, 220, 40),
    "white": (240, 240, 240),
}
BACKGROUND: tuple[int, int, int] = (20, 20, 24)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
COUNT_WORDS: dict[str, int] = {"a": 1, "one": 1, "two": 2, "three": 3}
NUMBER_WORDS: dict[int, str] = {1: "a", 2: "two", 3: "three"}
RELATIONS: dict[str, str] = {  # canonical name -> text
    "left_of": "to the left of",
    "right_of": "to the right of",
    "above": "above",
    "below": "below",
}
CATEGORIES: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")

# Colour+shape pairs that never appear in a train prompt (nor in a scene sampled for one): a
# compositional-generalisation probe. Test prompts that use them are marked by `uses_held_out`.
HELD_OUT_PAIRS: frozenset[tuple[str, str]] = frozenset({("red", "triangle"), ("green", "circle"), ("blue", "square")})

VOCAB: tuple[str, ...] = tuple(dict.fromkeys(
    [*COUNT_WORDS, *COLORS, *SHAPES, *(s + "s" for s in SHAPES), "and",
     *itertools.chain.from_iterable(t.split() for t in RELATIONS.values())]))

# Scene layout (fractions of the image side). At 32x32: objects are 9-13 px wide, >= 2.5 px apart (smaller
# discs are hard to tell from squares with a pixel missing at each corner).
MIN_SIZE, MAX_SIZE = 0.28, 0.40
GAP = 0.08      # minimum free space between the bounding boxes of two objects
EDGE = 0.04     # minimum free space between an object and the image border


def split_words(text: str) -> list[str]:
    """Lower-case and split on whitespace; the one normalisation used by the parser and the tokenizer."""
    return text.lower().split()


def _check_known(words: list[str], text: str) -> None:
    for w in words:
        if w not in VOCAB:
            raise ValueError(f"unknown word {w!r} in prompt {text!r}; the shapes world knows only: {' '.join(VOCAB)}")


@dataclass(frozen=True)
class ObjectSpec:
    """`count` objects of `shape`, all of `color` (None: any colour, chosen per object by the sampler)."""

    shape: str
    color: str | None = None
    count: int = 1

    def __post_init__(self):
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}; use one of {SHAPES}")
        if self.color is not None and self.color not in COLORS:
            raise ValueError(f"unknown colour {self.color!r}; use one of {tuple(COLORS)}")
        if self.count not in NUMBER_WORDS:
            raise ValueError(f"count must be one of {tuple(NUMBER_WORDS)}, got {self.count}")

    def matches(self, color: str, shape: str) -> bool:
        return shape == self.shape and (self.color is None or color == self.color)

    def to_text(self) -> str:
        noun = self.shape + ("s" if self.count > 1 else "")
        return " ".join(w for w in (NUMBER_WORDS[self.count], self.color, noun) if w)


@dataclass(frozen=True)
class PromptSpec:
    """A parsed prompt: one or two object specs and, for `position` prompts, the relation of the first
    object to the second (`relation` in RELATIONS; None means the objects are joined by "and")."""

    objects: tuple[ObjectSpec, ...]
    relation: str | None = None

    def __post_init__(self):
        objs = self.objects
        if len(objs) not in (1, 2):
            raise ValueError(f"a prompt describes one or two object specs, got {len(objs)}")
        if self.relation is not None and (self.relation not in RELATIONS or len(objs) != 2):
            raise ValueError(f"relation must be one of {tuple(RELATIONS)} between two objects, got {self.relation!r}")
        if len(objs) == 2:
            a, b = objs
            if a.count != 1 or b.count != 1:
                raise ValueError("counts above one are only supported in single-object prompts ('three red circles')")
            if a == b:
                raise ValueError(f"both objects are {a.to_text()!r}; write 'two ...' for a counting prompt")
            if self.relation is not None and a.shape == b.shape and (a.color is None or b.color is None):
                raise ValueError("the two objects of a position prompt must be told apart: give them different shapes, "
                                 "or colours to both")

    @property
    def category(self) -> str:
        objs = self.objects
        if self.relation is not None:
            return "position"
        if len(objs) == 2:
            return "color_attr" if any(o.color for o in objs) else "two_object"
        if objs[0].count > 1:
            return "counting"
        return "colors" if objs[0].color else "single_object"

    def to_text(self) -> str:
        if len(self.objects) == 1:
            return self.objects[0].to_text()
        a, b = (o.to_text() for o in self.objects)
        return f"{a} {RELATIONS[self.relation] if self.relation else 'and'} {b}"


def _parse_object(words: list[str], i: int, text: str) -> tuple[ObjectSpec, int]:
    if i >= len(words) or words[i] not in COUNT_WORDS:
        got = repr(words[i]) if i < len(words) else "the end of the prompt"
        raise ValueError(f"expected a count word {tuple(COUNT_WORDS)} at {got} in prompt {text!r}")
    count = COUNT_WORDS[words[i]]
    i += 1
    color = None
    if i < len(words) and words[i] in COLORS:
        color, i = words[i], i + 1
    if i >= len(words):
        raise ValueError(f"prompt {text!r} ends before the shape word")
    word = words[i]
    want = SHAPES if count == 1 else tuple(s + "s" for s in SHAPES)
    if word not in want:
        raise ValueError(f"expected one of {want} after {' '.join(words[:i])!r} in prompt {text!r}, got {word!r}")
    return ObjectSpec(word.removesuffix("s") if count > 1 else word, color, count), i + 1


@functools.lru_cache(maxsize=4096)
def parse_prompt(text: str) -> PromptSpec:
    """Parse a prompt of the grammar above (case and extra spaces are ignored).

    Raises ValueError naming the word for words outside `VOCAB`, and saying what was expected otherwise.
    `parse_prompt(spec.to_text()) == spec` for every valid spec.
    """
    words = split_words(text)
    if not words:
        raise ValueError("empty prompt: the shapes world needs at least one object ('a red circle')")
    _check_known(words, text)
    first, i = _parse_object(words, 0, text)
    if i == len(words):
        return PromptSpec((first,))
    relation = None
    if words[i] == "and":
        i += 1
    else:
        for name, rel_text in RELATIONS.items():
            n = len(rel_text.split())
            if words[i:i + n] == rel_text.split():
                relation, i = name, i + n
                break
        else:
            raise ValueError(f"expected 'and' or a relation {tuple(RELATIONS.values())} at {words[i]!r} "
                             f"in prompt {text!r}")
    second, i = _parse_object(words, i, text)
    if i != len(words):
        raise ValueError(f"unexpected words {' '.join(words[i:])!r} at the end of prompt {text!r}")
    return PromptSpec((first, second), relation)


# ----------------------------------------------------------------------------- scenes

@dataclass(frozen=True)
class SceneObject:
    """One flat-coloured object. `center` = (x, y) and `size` (width = height of the bounding box) are
    fractions of the image side; y points down."""

    color: str
    shape: str
    center: tuple[float, float]
    size: float


@dataclass(frozen=True)
class Scene:
    objects: tuple[SceneObject, ...]

    def to_dict(self) -> dict:
        return {"objects": [asdict(o) for o in self.objects]}

    @staticmethod
    def from_dict(d: dict) -> "Scene":
        return Scene(tuple(SceneObject(o["color"], o["shape"], tuple(o["center"]), o["size"]) for o in d["objects"]))


def _apart(p: tuple[float, float], s: float, q: tuple[float, float], t: float) -> bool:
    d = (s + t) / 2 + GAP
    return abs(p[0] - q[0]) >= d or abs(p[1] - q[1]) >= d


def _relation_holds(rel: str, p: tuple[float, float], s: float, q: tuple[float, float], t: float) -> bool:
    """Sampler's (strict) version: the offset along the relation's axis clears both objects plus GAP, and
    dominates the offset along the other axis, so the scene is unambiguous."""
    dx, dy = q[0] - p[0], q[1] - p[1]  # from the first object to the second
    along, across = {"left_of": (dx, dy), "right_of": (-dx, dy), "above": (dy, dx), "below": (-dy, dx)}[rel]
    return along >= (s + t) / 2 + GAP and abs(across) <= along


def sample_scene(spec: PromptSpec | str, rng: np.random.Generator | int | None = None, *,
                 allow_held_out: bool = False, max_tries: int = 100) -> Scene:
    """A random scene that satisfies `spec` exactly: the objects it names and nothing else.

    Objects whose colour the prompt leaves open get a random colour, avoiding HELD_OUT_PAIRS unless
    `allow_held_out`, and avoiding colours the prompt names for the same shape (so "a red circle and a
    circle" never gets two red circles). Objects never overlap; `position` relations hold with margin.
    """
    spec = parse_prompt(spec) if isinstance(spec, str) else spec
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    named = {(o.color, o.shape) for o in spec.objects if o.color}
    kinds = []
    for o in spec.objects:
        free = [c for c in COLORS
                if (c, o.shape) not in named and (allow_held_out or (c, o.shape) not in HELD_OUT_PAIRS)]
        kinds += [(o.color or free[rng.integers(len(free))], o.shape) for _ in range(o.count)]
    for _ in range(max_tries):  # place objects one by one; start over when one does not fit
        sizes = rng.uniform(MIN_SIZE, MAX_SIZE, len(kinds))
        centers: list[tuple[float, float]] = []
        for i, z in enumerate(sizes):
            for _ in range(50):
                p = tuple(float(v) for v in rng.uniform(EDGE + z / 2, 1 - EDGE - z / 2, 2))
                if all(_apart(p, z, q, sizes[j]) for j, q in enumerate(centers)) and (
                        i != 1 or spec.relation is None or _relation_holds(spec.relation, centers[0], sizes[0], p, z)):
                    centers.append(p)
                    break
            else:
                break
        if len(centers) == len(kinds):
            return Scene(tuple(SceneObject(c, s, p, float(z)) for (c, s), p, z in zip(kinds, centers, sizes)))
    raise RuntimeError(f"could not place the objects of {spec.to_text()!r} in {max_tries} tries; raise max_tries")


# ----------------------------------------------------------------------------- prompt splits

SPLIT_SEED = 20240607
# Per category: (test prompts that use only seen colour+shape pairs, test prompts that use a held-out pair).
TEST_QUOTA: dict[str, tuple[int, int]] = {
    "single_object": (1, 0), "two_object": (2, 0), "colors": (3, 3),
    "counting": (6, 6), "color_attr": (12, 12), "position": (12, 12),
}
TRAIN_CAP: dict[str, int] = {"position": 160}  # the position grammar alone has 504 prompts


def uses_held_out(spec: PromptSpec | str) -> bool:
    """Whether the prompt names a colour+shape pair from HELD_OUT_PAIRS (never in a train prompt)."""
    spec = parse_prompt(spec) if isinstance(spec, str) else spec
    return any((o.color, o.shape) in HELD_OUT_PAIRS for o in spec.objects)


def all_prompts() -> dict[str, list[PromptSpec]]:
    """Every prompt the splits draw from, by category, in a fixed order. Two-object prompts use two
    different shapes, and different colours when coloured (plus uncoloured `counting`/`position`)."""
    pairs = [(a, b) for a in SHAPES for b in SHAPES if a != b]
    cols = [(a, b) for a in COLORS for b in COLORS if a != b]
    O = ObjectSpec
    return {
        "single_object": [PromptSpec((O(s),)) for s in SHAPES],
        "colors": [PromptSpec((O(s, c),)) for c in COLORS for s in SHAPES],
        "counting": [PromptSpec((O(s, c, n),)) for n in (2, 3) for c in (None, *COLORS) for s in SHAPES],
        "two_object": [PromptSpec((O(a), O(b))) for a, b in pairs],
        "color_attr": [PromptSpec((O(a, ca), O(b, cb))) for a, b in pairs for ca, cb in cols],
        "position": [PromptSpec((O(a, ca), O(b, cb)), r) for r in RELATIONS for a, b in pairs
                     for ca, cb in [(None, None), *cols]],
    }


def _interleave(*lists: list[str]) -> list[str]:
    return [x for group in itertools.zip_longest(*lists) for x in group if x is not None]


@functools.lru_cache(maxsize=None)
def _splits() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Per category: a seeded shuffle; the first prompts (by TEST_QUOTA) go to test, the rest of the seen
    ones to train; held-out prompts beyond the quota are dropped. Categories are interleaved, so any prefix
    of a split covers every category."""
    rng = np.random.default_rng(SPLIT_SEED)
    train, test = [], []
    for cat, specs in all_prompts().items():
        specs = [specs[i] for i in rng.permutation(len(specs))]
        seen = [s.to_text() for s in specs if not uses_held_out(s)]
        held = [s.to_text() for s in specs if uses_held_out(s)]
        n_seen, n_held = TEST_QUOTA[cat]
        test.append(_interleave(seen[:n_seen], held[:n_held]))
        train.append(seen[n_seen:][:TRAIN_CAP.get(cat)])
    return tuple(_interleave(*train)), tuple(_interleave(*test))


def train_prompts() -> list[str]:
    """The fixed train split (~260 prompts, all categories, no held-out colour+shape pair)."""
    return list(_splits()[0])


def test_prompts() -> list[str]:
    """The fixed test split (69 prompts, all categories, 33 of them using a held-out pair); disjoint from train."""
    return list(_splits()[1])


test_prompts.__test__ = False  # not a pytest test, even when imported into a test module
