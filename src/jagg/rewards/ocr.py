"""The OCR reward of Flow-GRPO's text-rendering task: how closely the text read off the image matches the quoted text of
its prompt.

Registered as ``ocr`` (:mod:`jagg.rewards.registry`). For each image and prompt, as Flow-GRPO's ``OcrScorer``:

1. the target is the prompt's text between its first and second double quote (``prompt.split('"')[1]``: ``a sign
   that says "Hello World"`` -> ``Hello World``);
2. the OCR engine reads the image; the recognised text is its lines with a confidence > 0, joined without separator;
3. both have their spaces removed (``' '`` only) and are lowercased;
4. the distance is 0 when the target occurs in the recognised text, else their Levenshtein distance, capped at the
   target's length; the reward is ``1 - distance / len(target)``, in [0, 1].

Where Flow-GRPO would crash or guess, jagg refuses with the sample named: a prompt without a double quote (Flow-GRPO:
IndexError), a quoted text that is empty once spaces are removed (Flow-GRPO: division by zero), and an engine that
raises on an image (Flow-GRPO scores it 0 and prints the error, which trains towards whatever broke the engine).

The engine: by default PaddleOCR 2.x as Flow-GRPO builds it (``PaddleOCR(use_angle_cls=False, lang="en",
use_gpu=False, show_log=False)``, ``ocr(image, cls=False)``), an optional extra: ``pip install 'jagg[ocr]'``.
PaddleOCR fetches its small detection and recognition models into ``~/.paddleocr`` the first time it is built; on a
machine without internet, build it once where there is (``python -c "from paddleocr import PaddleOCR;
PaddleOCR(lang='en')"``) and copy that directory. A missing engine is refused when the config loads, with the
install command. ``engine=package.module:attribute`` uses another engine: a callable ``(image uint8 [H, W, 3]) ->
[(text, confidence), ...]``, or a class of them (built with no arguments).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import numpy as np

from .images import to_uint8
from .user_code import instantiated

PADDLE = "paddleocr"
INSTALL = "pip install 'jagg[ocr]'"


def quoted_text(prompt: str, i: int = 0) -> str:
    """The text between the first two double quotes of ``prompt`` (all after the first when there is one quote);
    a ValueError naming sample ``i`` when there is none."""
    parts = prompt.split('"')
    if len(parts) < 2:
        raise ValueError(f"sample {i}: prompt {prompt[:100]!r} has no text in double quotes; the OCR reward scores an "
                         "image against the quoted text of its prompt (Flow-GRPO's dataset/ocr prompts: ... \"TEXT\" "
                         "...)")
    return parts[1]


def normalised(text: str) -> str:
    """``text`` without spaces, lowercased (Flow-GRPO's normalisation of both texts)."""
    return text.replace(" ", "").lower()


def levenshtein(a: str, b: str) -> int:
    """The edit distance of ``a`` and ``b``: insertions, deletions and substitutions of one character, each 1."""
    if len(a) < len(b):
        a, b = b, a
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def ocr_reward(recognised: str, target: str) -> tuple[float, int]:
    """``(1 - distance / len(target), distance)`` of the normalised texts (module docstring, steps 3 and 4);
    ``target`` must be non-empty once normalised."""
    text, want = normalised(recognised), normalised(target)
    dist = 0 if want in text else min(levenshtein(text, want), len(want))
    return 1.0 - dist / len(want), dist


class PaddleEngine:
    """PaddleOCR 2.x as Flow-GRPO builds and calls it: ``(image uint8 [H, W, 3]) -> [(text, confidence), ...]``."""

    def __init__(self, use_gpu: bool = False):
        check_paddle()
        from paddleocr import PaddleOCR

        self.ocr = PaddleOCR(use_angle_cls=False, lang="en", use_gpu=use_gpu, show_log=False)

    def __call__(self, image: np.ndarray) -> list[tuple[str, float]]:
        result = self.ocr.ocr(image, cls=False)
        lines = result[0] if result else None
        return [(line[1][0], float(line[1][1])) for line in lines] if lines else []


def check_paddle() -> None:
    """Raise a ValueError with the install command unless PaddleOCR 2.x and PaddlePaddle are installed (found
    without importing them)."""
    missing = [m for m in (PADDLE, "paddle") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"the ocr reward's engine is not installed (no module {' nor '.join(missing)}): {INSTALL} "
                         "(PaddleOCR 2.x and PaddlePaddle, as Flow-GRPO), or give engine=package.module:function")
    version = importlib.metadata.version(PADDLE)
    if int(version.split(".")[0]) >= 3:
        raise ValueError(f"the ocr reward calls PaddleOCR as Flow-GRPO does (the 2.x API); paddleocr {version} is "
                         f"installed: {INSTALL} (paddleocr>=2.9,<3)")


def _engine(engine, use_gpu: bool):
    """The OCR engine that ``engine`` names: ``"paddleocr"``, ``package.module:attribute`` or a callable."""
    if callable(engine):
        return engine
    if engine == PADDLE:
        return PaddleEngine(use_gpu)
    if not isinstance(engine, str):
        raise ValueError(f"engine must be {PADDLE!r}, 'package.module:attribute' or a callable; got {engine!r}")
    return instantiated(engine, "the OCR engine", "(image uint8 [H, W, 3]) -> [(text, confidence), ...]")

class OcrReward:
    """Reward callable: Flow-GRPO's OCR reward (module docstring). ``engine``: ``"paddleocr"``,
    ``package.module:attribute`` or a callable ``(image uint8 [H, W, 3]) -> [(text, confidence), ...]``;
    ``use_gpu``: PaddleOCR on the GPU (Flow-GRPO: false)."""

    @classmethod
    def check_options(cls, options: dict) -> None:
        """At config load: the default engine installed (found, not imported), another one a well-formed name."""
        engine = options.get("engine", PADDLE)
        if engine == PADDLE:
            check_paddle()
        elif isinstance(engine, str) and not all(engine.partition(":")[::2]):
            raise ValueError(f"engine must be {PADDLE!r} or 'package.module:attribute'; got {engine!r}")

    def __init__(self, engine=PADDLE, use_gpu: bool = False):
        self.engine = _engine(engine, use_gpu)

    def read(self, image: np.ndarray, i: int) -> str:
        """The engine's text of sample ``i``: its lines of confidence > 0, joined; an error names the sample."""
        try:
            lines = self.engine(image)
            return "".join(text for text, confidence in lines if confidence > 0)
        except Exception as e:
            raise RuntimeError(f"sample {i}: the OCR engine failed ({type(e).__name__}: {e}); it must return "
                               "[(text, confidence), ...] for an image") from e

    def __call__(self, images, prompts, metadata=None) -> tuple[np.ndarray, dict]:
        images = to_uint8(images)
        if len(prompts) != len(images):
            raise ValueError(f"got {len(images)} images and {len(prompts)} prompts")
        targets = [quoted_text(p, i) for i, p in enumerate(prompts)]
        empty = [i for i, t in enumerate(targets) if not normalised(t)]
        if empty:
            raise ValueError(f"sample {empty[0]}: prompt {prompts[empty[0]][:100]!r} quotes no text (empty once "
                             "spaces are removed); the OCR reward needs a text to read")
        texts = [self.read(im, i) for i, im in enumerate(images)]
        scored = [ocr_reward(t, want) for t, want in zip(texts, targets)]
        return (np.array([s for s, _ in scored], dtype=np.float32),
                {"ocr_distance": np.array([d for _, d in scored]), "ocr_text": [normalised(t) for t in texts]})
