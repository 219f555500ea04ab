"""A reward callable that scores images on an HTTP reward server (:mod:`jagg.rewards.server`).

Every jagg reward is a callable ``(images, prompts list[str], metadata list[dict] | None) -> (scores np.float32 [N],
info dict)``. :class:`RewardClient` is one too: it sends the batch, in chunks, to a reward server (a GPU box running
PickScore, an OCR model, a VLM judge, ...) and returns what the server scored. The wire format is in
:mod:`jagg.rewards.protocol`.

Failures: a timeout (``timeout`` is a deadline for the whole request), a connection error, a broken HTTP answer
(truncated body, not HTTP at all) or a 5xx/429 answer is retried with exponential backoff; a 4xx answer (bad
request, wrong token, body too large, the reward failed on this input), non-finite or missing scores and a non-JSON
answer are not. What still fails raises :class:`RewardServerError` naming the server URL.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar

import numpy as np

from ..checks import check_count
from .images import to_uint8
from .protocol import IMAGE_FORMATS, TOKEN_ENV, auth_header, bad_scores, encode_images, jsonable


class RewardServerError(RuntimeError):
    """A request failed: names the server URL, the failing sample indices (empty for ``health()``), the number of
    attempts and the last cause."""

    def __init__(self, url: str, indices: Sequence[int], cause: str, attempts: int):
        self.url, self.indices, self.cause, self.attempts = url, list(indices), cause, attempts
        what = (f"failed on batch samples [{self.indices[0]}..{self.indices[-1]}] ({len(self.indices)} images)"
                if self.indices else "failed")
        super().__init__(f"reward server {url} {what} after {attempts} attempt(s): {cause}")


class _Retryable(Exception):
    """A failure that another attempt may not repeat (timeout, connection, broken answer, 5xx, 429)."""


class _Final(Exception):
    """A failure that another attempt would repeat (4xx, bad scores, not JSON)."""


@dataclass
class RewardClient:
    """Reward callable that scores images on an HTTP reward server.

    Call: ``(images, prompts list[str], metadata list[dict] | None) -> (scores np.float32 [N], info dict)``, with
    images as every local reward takes them (:func:`jagg.rewards.images.to_uint8`): uint8 ``[N, H, W, 3]`` (numpy or
    torch) or a float tensor ``[N, 3, H, W]`` in [-1, 1]. Per-sample info lists of the chunks are concatenated
    (numeric ones as arrays); other info values are collected per chunk in a list. Connects directly (no HTTP proxy).
    """

    url: str = field(metadata={"help": "Server base URL, e.g. http://127.0.0.1:8000 (POST <url>/score)."})
    batch_size: int = field(default=32, metadata={"help": "Images per request."})
    timeout: float = field(default=120.0, metadata={"help": "Seconds one request may take in all (connect, send, "
                                                             "score, answer)."})
    retries: int = field(default=3, metadata={"help": "Extra attempts after a timeout, connection error, broken "
                                                      "answer or 5xx/429 (never after a 4xx)."})
    backoff: float = field(default=1.0, metadata={"help": "Seconds before the first retry; doubles each retry."})
    image_format: str = field(default="png", metadata={"help": f"Wire format of the images, one of {IMAGE_FORMATS} "
                              "(png: lossless and smaller; npy: no encoding cost)."})
    concurrency: int = field(default=1, metadata={"help": "Requests in flight at once."})
    token: str | None = field(default=None, repr=False, metadata={"help": "Shared token of a server started with "
                              f"--token (sent as 'Authorization: Bearer <token>'); null: ${TOKEN_ENV} if set. Prefer "
                              "the environment variable: a config is saved into every checkpoint."})

    def __post_init__(self):
        self.url = check_url(self.url, "reward server url")
        for name, low in (("batch_size", 1), ("concurrency", 1), ("retries", 0)):
            setattr(self, name, check_count(getattr(self, name), f"reward server {name}", low))
        self.timeout = check_seconds(self.timeout, "reward server timeout")
        self.backoff = check_seconds(self.backoff, "reward server backoff", positive=False)
        if self.image_format not in IMAGE_FORMATS:
            raise ValueError(f"reward server image_format must be one of {IMAGE_FORMATS}; got {self.image_format!r}")
        if self.token is not None and (not isinstance(self.token, str) or not self.token):
            raise ValueError("reward server token must be a non-empty string or null (null: use "
                             f"${TOKEN_ENV} if set)")

    # -- one request -------------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: bytes | None = None) -> dict:
        """One HTTP request that ends within ``timeout`` seconds -> the JSON answer of a 2xx.
        Raises :class:`_Retryable` or :class:`_Final` with the cause."""
        headers = {"Content-Type": "application/json"}
        token = self.token or os.environ.get(TOKEN_ENV)
        if token:
            headers["Authorization"] = auth_header(token)
        return _answer(*http_request(self.url, method, path, body, headers, self.timeout))

    def health(self) -> dict:
        """``GET /health`` once (no retry) -> the server's answer; a :class:`RewardServerError` names the URL."""
        try:
            return self._request("GET", "/health")
        except (_Retryable, _Final) as e:
            raise RewardServerError(self.url, [], f"GET /health: {e}", 1) from e

    def _score_chunk(self, images: np.ndarray, prompts: list, metadata: list | None, indices: range) -> dict:
        body = json.dumps({"images": encode_images(images, self.image_format), "prompts": list(prompts),
                           "metadata": jsonable(metadata)}, allow_nan=False).encode()
        try:
            out, attempt = retried(lambda: self._request("POST", "/score", body), self.retries, self.backoff)
        except RequestFailed as e:
            raise RewardServerError(self.url, indices, e.cause, e.attempts) from e
        problem = bad_scores(out.get("scores"), len(indices))
        if not problem and not isinstance(out.get("info", {}), (dict, type(None))):
            problem = f"'info' must be a JSON object; got {str(out['info'])[:100]}"
        if problem:
            raise RewardServerError(self.url, indices, f"bad response: {problem}", attempt)
        return out

    def __call__(self, images, prompts: Sequence[str], metadata: Sequence[dict] | None = None):
        images = to_uint8(images)
        n = len(images)
        if len(prompts) != n or (metadata is not None and len(metadata) != n):
            raise ValueError(f"got {n} images, {len(prompts)} prompts and "
                             f"{'no' if metadata is None else len(metadata)} metadata entries")
        spans = [range(s, min(s + self.batch_size, n)) for s in range(0, n, self.batch_size)]

        def run(r: range) -> dict:
            return self._score_chunk(images[r.start:r.stop], list(prompts[r.start:r.stop]),
                                     None if metadata is None else list(metadata[r.start:r.stop]), r)

        if self.concurrency == 1 or len(spans) == 1:
            outs = [run(r) for r in spans]
        else:
            with ThreadPoolExecutor(self.concurrency) as pool:
                outs = list(pool.map(run, spans))
        scores = np.asarray([s for o in outs for s in o["scores"]], dtype=np.float32)
        return scores, _merge_info([o.get("info") or {} for o in outs], [len(r) for r in spans])


def check_url(url, what: str) -> str:
    """``url`` without its trailing slash; a ValueError naming ``what`` unless it is an http(s) URL."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{what} must start with http:// or https://; got {url!r}")
    return url.rstrip("/")


def check_seconds(value, what: str, positive: bool = True) -> float:
    """``value`` as a finite number of seconds (> 0, or >= 0 unless ``positive``); a ValueError naming ``what``."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
            or (positive and value == 0)):
        raise ValueError(f"{what} must be a finite number {'>' if positive else '>='} 0 (seconds); got {value!r}")
    return float(value)


class RequestFailed(Exception):
    """:func:`retried` gave up: ``cause`` of the last attempt, after ``attempts`` attempts."""

    def __init__(self, cause: str, attempts: int):
        self.cause, self.attempts = cause, attempts
        super().__init__(cause)


T = TypeVar("T")


def retried(call: Callable[[], T], retries: int, backoff: float) -> tuple[T, int]:
    """``call()`` -> ``(its value, the attempts it took)``: a :class:`_Retryable` failure is tried again up to
    ``retries`` times, ``backoff`` seconds before the first retry, doubling; a :class:`_Final` one is not. What still
    fails raises :class:`RequestFailed`."""
    cause, attempt = "", 0
    for attempt in range(1, retries + 2):
        try:
            return call(), attempt
        except _Retryable as e:
            cause = str(e)
            if attempt <= retries:
                time.sleep(backoff * 2 ** (attempt - 1))
        except _Final as e:
            raise RequestFailed(str(e), attempt) from e
    raise RequestFailed(cause, attempt)


def http_request(url: str, method: str, path: str, body: bytes | None, headers: dict, timeout: float
                 ) -> tuple[int, bytes]:
    """One HTTP request to ``url`` + ``path`` that ends within ``timeout`` seconds in all (connect, send, answer),
    directly (no HTTP proxy) -> ``(status, body)``. A timeout, a connection error or a broken answer (truncated, not
    HTTP) raises :class:`_Retryable` with the cause."""
    parts = urllib.parse.urlsplit(url)
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    deadline = time.monotonic() + timeout
    conn = conn_cls(parts.hostname, parts.port, timeout=timeout)
    expired = threading.Event()
    timer = None
    try:
        conn.connect()
        sock = conn.sock

        def expire():                                       # the deadline: unblock any read or write at once
            expired.set()
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        timer = threading.Timer(max(deadline - time.monotonic(), 0.0), expire)
        timer.daemon = True
        timer.start()
        try:
            conn.request(method, (parts.path + path) or "/", body=body, headers=headers)
        except (BrokenPipeError, ConnectionResetError):
            if expired.is_set():
                raise
            # the server may have answered before reading the whole body (e.g. 413): read that answer
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (OSError, http.client.HTTPException) as e:
        if expired.is_set() or isinstance(e, (TimeoutError, socket.timeout)):
            raise _Retryable(f"timed out after {timeout:g} s") from e
        raise _Retryable(f"connection error: {type(e).__name__}: {e}") from e
    finally:
        if timer is not None:
            timer.cancel()
        conn.close()


PROBE_TIMEOUT = 10.0                     # seconds a start-up probe of a reward's server may take


def probe_server(url: str, path: str, headers: dict, timeout: float, what: str) -> tuple[int, bytes]:
    """One ``GET`` of ``url`` + ``path`` when a reward is built, before a model loads -> ``(status, body)``;
    nothing answering within ``min(timeout, PROBE_TIMEOUT)`` seconds is a ValueError naming ``what`` and the URL."""
    try:
        return http_request(url, "GET", path, None, headers, min(timeout, PROBE_TIMEOUT))
    except _Retryable as e:
        raise ValueError(f"{what}: nothing answers at {url}{path} ({e}); start the server, fix the URL, or give "
                         "probe=false to let the first batch find out") from None


def _answer(status: int, raw: bytes) -> dict:
    """An HTTP answer -> its JSON object if 2xx; else :class:`_Retryable` (5xx, 429) or :class:`_Final` (4xx)."""
    try:
        out = json.loads(raw)
    except ValueError:
        out = None
    if 200 <= status < 300:
        if not isinstance(out, dict):
            raise _Final(f"bad response: HTTP {status} but not a JSON object ({raw[:100]!r})")
        return out
    msg = out.get("error") if isinstance(out, dict) else None
    text = f"HTTP {status}: {msg or http.client.responses.get(status) or repr(raw[:200])}"
    if status >= 500 or status == 429:
        raise _Retryable(text)
    raise _Final(text)                                          # the request itself is wrong: retrying cannot help


def _merge_info(infos: list[dict], sizes: list[int]) -> dict:
    merged: dict = {}
    for key in dict.fromkeys(k for i in infos for k in i):
        vals = [i.get(key) for i in infos]
        if all(isinstance(v, list) and len(v) == s for v, s in zip(vals, sizes)):
            flat = [x for v in vals for x in v]
            numeric = all(isinstance(x, (int, float, bool)) for x in flat)
            merged[key] = np.asarray(flat) if numeric else flat
        else:
            merged[key] = vals if len(vals) > 1 else vals[0]
    return merged
