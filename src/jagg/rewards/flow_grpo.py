"""A reward scored by one of the reward servers Flow-GRPO users run: GenEval, DeQA or UnifiedReward.

Registered as ``flow_grpo_remote`` (:mod:`jagg.rewards.registry`), its options in the name
(``flow_grpo_remote:server=geneval,url=http://127.0.0.1:18085``). These servers (yifan123/reward-server's Flask apps
under gunicorn, and UnifiedReward's) speak Flow-GRPO's protocol, not jagg's (:mod:`jagg.rewards.protocol`)::

    POST <url>  body: pickle of {"images": [JPEG bytes, ...],          every server
                                 "meta_datas": [metadata dict, ...],    geneval: each prompt's .jsonl object
                                 "only_strict": bool,                   geneval
                                 "prompts": [str, ...]}                 unifiedreward
           ->  200 pickle of {"scores", "rewards", "strict_rewards", "group_rewards",
                              "group_strict_rewards"}                       geneval
                             {"outputs": [score, ...]}                      deqa, unifiedreward
           ->  500 the server's traceback as text

The images are JPEG-encoded with Pillow's default quality (75) and sent in even chunks of at most ``batch_size`` (as
Flow-GRPO splits them). The reward is GenEval's ``scores`` (the partial credit Flow-GRPO trains on), or the
``outputs``. GenEval's info: ``strict_correct`` (its ``strict_rewards``), ``correct`` (``rewards``, GenEval's
accuracy, which ``jagg eval`` and the evaluation records report; only with ``only_strict=false``: a strict-only server
leaves it 0), and ``group_rewards`` / ``group_strict_rewards`` (per GenEval tag, one number per image, -10 for an
image of another tag, as the server sends them).

Trust: the request is a pickle, so the server runs ``pickle.loads`` on what any client sends it; keep it on loopback,
a trusted network or an SSH tunnel. Flow-GRPO also reads the answer with ``pickle.loads``, which hands whoever answers
on that port the training process. jagg reads it with :func:`jagg.rewards.safe_pickle.loads_plain` instead (plain
containers, numbers, strings and numeric arrays; any other global is refused by name and never runs), so a hostile
answer cannot run code, but it still decides the rewards you train on: point ``url`` only at a server you trust.

Failures: a timeout (``timeout`` is a deadline for the whole request), a connection error, a broken answer or a
5xx/429 is retried with exponential backoff; a 4xx, an answer that is not a plain pickle, or one without the keys or
lengths above is not. Each raises :class:`jagg.rewards.client.RewardServerError` naming the URL and the samples.
When the reward is built (the trainer builds it before the model loads), one ``GET`` checks that something answers at
``url`` (``probe``; any HTTP answer: these servers take POST only).
"""

from __future__ import annotations

import io
import math
import numbers
import pickle
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from ..checks import check_count
from .client import (RequestFailed, RewardServerError, _Final, _Retryable, check_seconds, check_url, http_request,
                     probe_server, retried)
from .images import to_uint8
from .safe_pickle import loads_plain

SERVERS = ("geneval", "deqa", "unifiedreward")
DEFAULT_URLS = {"geneval": "http://127.0.0.1:18085", "deqa": "http://127.0.0.1:18086"}   # Flow-GRPO's


def jpeg_bytes(image: np.ndarray) -> bytes:
    """uint8 ``[H, W, 3]`` -> JPEG bytes at Pillow's default quality, as Flow-GRPO sends images to its servers."""
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG")
    return buf.getvalue()


def even_chunks(n: int, batch_size: int) -> list[range]:
    """``range(n)`` split as ``np.array_split(x, ceil(n / batch_size))``: even chunks of at most ``batch_size``."""
    parts = np.array_split(np.arange(n), math.ceil(n / batch_size)) if n else []
    return [range(int(p[0]), int(p[-1]) + 1) for p in parts]


@dataclass
class FlowGrpoRemote:
    """Reward callable scored by a Flow-GRPO reward server (module docstring): ``(images, prompts, metadata) ->
    (scores float32 [N], info)``, images as every reward takes them (:func:`jagg.rewards.images.to_uint8`)."""

    server: str = field(default="geneval", metadata={"help": f"Which server answers at url, one of {SERVERS}."})
    url: str | None = field(default=None, metadata={"help": "The server's URL (Flow-GRPO POSTs to it as is); null: "
                            "Flow-GRPO's, http://127.0.0.1:18085 for geneval, :18086 for deqa (unifiedreward has "
                            "none)."})
    batch_size: int = field(default=64, metadata={"help": "Images per request at most (Flow-GRPO: 64)."})
    timeout: float = field(default=120.0, metadata={"help": "Seconds one request may take in all."})
    retries: int = field(default=3, metadata={"help": "Extra attempts after a timeout, connection error, broken "
                                                      "answer or 5xx/429 (never after a 4xx or a bad answer)."})
    backoff: float = field(default=1.0, metadata={"help": "Seconds before the first retry; doubles each retry."})
    only_strict: bool = field(default=True, metadata={"help": "geneval: score the strict reward only (Flow-GRPO's "
                              "training); false also computes GenEval's accuracy (info 'correct'), as its evaluation."})
    probe: bool = field(default=True, metadata={"help": "When the reward is built (before the model loads), check that "
                        "an HTTP server answers at url (any answer: these servers take POST only); false: the first "
                        "batch finds out."})

    @classmethod
    def check_options(cls, options: dict) -> None:
        """The spec's options checked at config load (nothing is sent)."""
        cls(**{**options, "probe": False})

    def __post_init__(self):
        if self.server not in SERVERS:
            raise ValueError(f"server must be one of {SERVERS}; got {self.server!r}")
        if self.url is None:
            if self.server not in DEFAULT_URLS:
                raise ValueError(f"url= is required for server={self.server} (e.g. url=http://127.0.0.1:18087)")
            self.url = DEFAULT_URLS[self.server]
        self.url = check_url(self.url, "url")
        self.batch_size = check_count(self.batch_size, "batch_size")
        self.retries = check_count(self.retries, "retries", 0)
        self.timeout = check_seconds(self.timeout, "timeout")
        self.backoff = check_seconds(self.backoff, "backoff", positive=False)
        for name in ("only_strict", "probe"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false; got {getattr(self, name)!r}")
        if self.probe:
            probe_server(self.url, "", {}, self.timeout, f"flow_grpo_remote (server={self.server})")

    def request(self, images: np.ndarray, prompts: list[str], metadata: list | None) -> dict:
        """The request body of one chunk, as Flow-GRPO sends it to this kind of server."""
        body: dict = {"images": [jpeg_bytes(im) for im in images]}
        if self.server == "geneval":
            if metadata is None or any(not isinstance(m, dict) for m in metadata):
                raise ValueError("server=geneval needs each prompt's GenEval metadata (tag, include, ...): give "
                                 "sample.prompts_file a .jsonl such as Flow-GRPO's dataset/geneval/"
                                 "train_metadata.jsonl, not a .txt")
            body.update(meta_datas=list(metadata), only_strict=self.only_strict)
        elif self.server == "unifiedreward":
            body["prompts"] = list(prompts)
        return body

    def _post(self, body: bytes) -> dict:
        status, raw = http_request(self.url, "POST", "", body, {"Content-Type": "application/octet-stream"},
                                   self.timeout)
        if not 200 <= status < 300:
            lines = raw.decode("utf-8", "replace").strip().splitlines()
            text = f"HTTP {status}: {lines[-1][:300] if lines else '(empty answer)'}"
            raise (_Retryable if status >= 500 or status == 429 else _Final)(text)
        try:
            out = loads_plain(raw)
        except Exception as e:                                # any pickle that is not plain data
            raise _Final(f"bad response: not a plain pickle ({type(e).__name__}: {e}); the first bytes: "
                         f"{raw[:60]!r}") from None
        if not isinstance(out, dict):
            raise _Final(f"bad response: a pickled {type(out).__name__}, not a dict")
        return out

    def _score_chunk(self, images, prompts, metadata, indices: range) -> tuple[np.ndarray, dict]:
        body = pickle.dumps(self.request(images, prompts, metadata))
        try:
            out, attempt = retried(lambda: self._post(body), self.retries, self.backoff)
        except RequestFailed as e:
            raise RewardServerError(self.url, indices, e.cause, e.attempts) from e
        try:
            return self.read(out, len(indices))
        except ValueError as e:
            raise RewardServerError(self.url, indices, f"bad response: {e}", attempt) from None

    def read(self, out: dict, n: int) -> tuple[np.ndarray, dict]:
        """A server's answer to ``n`` images -> ``(scores [n], info)``; a ValueError names the key that is wrong."""
        if self.server != "geneval":
            return numbers_of(out, "outputs", n), {}
        info = {"strict_correct": numbers_of(out, "strict_rewards", n)}
        if not self.only_strict:
            info["correct"] = numbers_of(out, "rewards", n)
        for key in ("group_rewards", "group_strict_rewards"):
            groups = out.get(key)
            if not isinstance(groups, dict):
                raise ValueError(f"'{key}' must be a dict (GenEval tag -> one number per image); got "
                                 f"{str(groups)[:100]}")
            info[key] = {str(tag): numbers_of(groups, tag, n, key) for tag in groups}
        return numbers_of(out, "scores", n), info

    def __call__(self, images, prompts, metadata=None) -> tuple[np.ndarray, dict]:
        images = to_uint8(images)
        n = len(images)
        if len(prompts) != n or (metadata is not None and len(metadata) != n):
            raise ValueError(f"got {n} images, {len(prompts)} prompts and "
                             f"{'no' if metadata is None else len(metadata)} metadata entries")
        parts = [self._score_chunk(images[r.start:r.stop], list(prompts[r.start:r.stop]),
                                   None if metadata is None else list(metadata[r.start:r.stop]), r)
                 for r in even_chunks(n, self.batch_size)]          # none for a process with no image to score
        scores = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0)
        return scores.astype(np.float32), _joined([p[1] for p in parts])


def numbers_of(out: dict, key, n: int, where: str = "") -> np.ndarray:
    """``out[key]`` as float64 ``[n]``: a list, tuple or 1-D numeric array of ``n`` finite real numbers (bools count
    as 0 and 1); otherwise a ValueError naming the key (inside ``where``)."""
    name = f"'{where}'[{key!r}]" if where else f"'{key}'"
    if key not in out:
        raise ValueError(f"no {name} in the answer (its keys: {sorted(map(str, out))[:10]})")
    value = out[key]
    ok = isinstance(value, (list, tuple, np.ndarray)) and np.ndim(value) == 1 and len(value) == n
    if ok and not isinstance(value, np.ndarray):
        ok = all(isinstance(v, (numbers.Real, np.bool_)) for v in value)
    arr = np.asarray(value, dtype=np.float64) if ok else None
    if arr is None or not np.isfinite(arr).all():
        raise ValueError(f"{name} must be {n} finite numbers, one per image; got {str(value)[:200]}")
    return arr


def _joined(infos: list[dict]) -> dict:
    """The info of each chunk, its per-image arrays concatenated (a dict of them, such as GenEval's groups, key by
    key: a tag missing from a chunk is -10 there, as GenEval marks another tag's images)."""
    out: dict = {}
    for key in infos[0] if infos else ():
        if isinstance(infos[0][key], dict):
            tags = dict.fromkeys(t for i in infos for t in i[key])
            sizes = [len(i["strict_correct"]) for i in infos]
            out[key] = {t: np.concatenate([i[key].get(t, np.full(s, -10.0)) for i, s in zip(infos, sizes)])
                        for t in tags}
        else:
            out[key] = np.concatenate([i[key] for i in infos])
    return out
