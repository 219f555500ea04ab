"""A reward server: serve any jagg reward over HTTP, a registry name (with its options) or a callable.

Every jagg reward is a callable ``(images uint8 [N, H, W, 3], prompts list[str], metadata list[dict] | None) ->
(scores float32 [N], info dict)``. This server scores ``POST /score`` requests with one (wire format:
:mod:`jagg.rewards.protocol`); :class:`jagg.rewards.RewardClient` is the matching reward callable for the trainer.
Serve a registry reward by its spec (:mod:`jagg.rewards.registry`; ``--kwargs`` are more options) or any reward
callable (``module:function``; a class is instantiated with ``--kwargs``)::

    python -m jagg.rewards.server --reward pickscore:path=/models/PickScore_v1,processor=/models/CLIP-ViT-H-14
    python -m jagg.rewards.server --reward hpsv2 --kwargs '{"path": "/models/HPS_v2.1_compressed.pt",
        "processor": "/models/CLIP-ViT-H-14-laion2B-s32B-b79K", "batch_size": 16}'
    python -m jagg.rewards.server --reward jagg.shapes.geneval:GenevalReward --port 8000

The server prints ``jagg reward server listening on http://HOST:PORT`` once ready (``--port 0`` picks a free port).
It binds to 127.0.0.1 unless ``--host`` says otherwise. Answers: 200 with the scores; 400 naming the wrong or
missing field of a bad request; 401 without the token (``--token`` or ``$JAGG_REWARD_TOKEN``); 408 when the body
does not arrive within ``--read-timeout`` seconds; 411/413 without a Content-Length or over ``--max-body-mb``; 422
when the reward raised or returned wrong scores (wrong count, NaN, inf) on this input. Calls to the reward are
serialised (models are rarely thread-safe); at most ``--max-connections`` requests are handled at once.

The preference models (``clip_score``, ``pickscore``, ``hpsv2``, ``aesthetic``: :mod:`jagg.rewards.preference`) load
their weights from local paths only; a missing path is an error naming it, never a silent zero.
"""

from __future__ import annotations

import argparse
import hmac
import importlib
import inspect
import ipaddress
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import numpy as np

from .protocol import TOKEN_ENV, auth_header, decode_images, jsonable
from .registry import CheckedReward, build_reward, parse_spec, registered_name

RewardFn = Callable[..., tuple]


# ----------------------------------------------------------------------------------------------------------------
# server
# ----------------------------------------------------------------------------------------------------------------


def load_reward(spec: str, kwargs: dict | None = None) -> RewardFn:
    """A registry spec (``"pickscore:path=/models/x"``, with ``kwargs`` as more options) or ``"module:attr"`` -> a
    reward callable. A class is instantiated with ``kwargs``; a function is used as is."""
    if registered_name(spec):
        name, options = parse_spec(spec)
        twice = sorted(set(options) & set(kwargs or {}))
        if twice:
            raise ValueError(f"option(s) {twice} are given both in --reward {spec!r} and in --kwargs; give each once")
        return build_reward(name, {**(kwargs or {}), **options})
    if ":" not in spec:
        raise ValueError(f"reward must be a registry name (e.g. pickscore:path=/models/PickScore_v1) or "
                         f"'module:function' (e.g. jagg.shapes.geneval:GenevalReward); got {spec!r}")
    mod_name, attr = spec.split(":", 1)
    try:
        obj = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load reward {spec!r}: {e}") from e
    if inspect.isclass(obj):
        return obj(**(kwargs or {}))
    if kwargs:
        raise ValueError(f"--kwargs only apply to a class; {spec} is a function")
    if not callable(obj):
        raise ValueError(f"{spec} is not callable")
    return obj


def parse_score_request(body: bytes) -> tuple[np.ndarray, list[str], list | None]:
    """The body of ``POST /score`` -> ``(images, prompts, metadata)``; a ValueError names the wrong field."""
    try:
        req = json.loads(body)
    except ValueError as e:
        raise ValueError(f"the body is not JSON ({e})") from None
    if not isinstance(req, dict):
        raise ValueError(f"the body must be a JSON object {{'images': ..., 'prompts': [...], 'metadata': ...}}; "
                         f"got a JSON {type(req).__name__}")
    missing = [k for k in ("images", "prompts") if k not in req]
    if missing:
        raise ValueError(f"missing field(s) {missing}; the body needs 'images' and 'prompts' ('metadata' optional)")
    images = decode_images(req["images"])
    prompts, metadata = req["prompts"], req.get("metadata")
    if not isinstance(prompts, list) or len(prompts) != len(images) or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"'prompts' must be a list of {len(images)} strings (one per image); got {str(prompts)[:80]}")
    if metadata is not None and (not isinstance(metadata, list) or len(metadata) != len(images)):
        raise ValueError(f"'metadata' must be null or a list of {len(images)} entries (one per image); got "
                         f"{str(metadata)[:80]}")
    return images, prompts, metadata


class _Handler(BaseHTTPRequestHandler):
    server_version = "jagg-reward/1"
    timeout: float                                              # per socket read/write (StreamRequestHandler)
    reward_fn: CheckedReward
    reward_name: str
    lock: threading.Lock
    token: str | None
    max_body: int

    def log_message(self, fmt, *args):                          # quiet; errors are returned to the client
        pass

    def _send(self, code: int, payload: dict) -> None:
        body = json.dumps(payload, allow_nan=False).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if code >= 400:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):        # the client gave up (timeout)
            pass

    def _authorised(self) -> bool:
        if not self.token:
            return True
        got = self.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if hmac.compare_digest(got, auth_header(self.token).encode("utf-8", "surrogateescape")):
            return True
        self._send(401, {"error": "missing or wrong token: this server was started with a token (--token or "
                                  f"${TOKEN_ENV}); give the client the same one (reward_server.token or "
                                  f"${TOKEN_ENV})"})
        return False

    def _body(self) -> bytes | None:
        """The request body, or None after answering why it cannot be read."""
        length = self.headers.get("Content-Length")
        if length is None:
            self._send(411, {"error": "a Content-Length header is required (chunked bodies are not accepted)"})
            return None
        if not length.strip().isdigit():
            self._send(400, {"error": f"bad request: Content-Length {length!r} is not a byte count"})
            return None
        if int(length) > self.max_body:
            self._send(413, {"error": f"request body of {int(length)} bytes is over this server's limit of "
                                      f"{self.max_body} bytes (--max-body-mb {self.max_body / 2**20:.4g}): send fewer "
                                      "images per request (reward_server.batch_size) or raise --max-body-mb"})
            return None
        try:
            body = self.rfile.read(int(length))
        except TimeoutError:
            self._send(408, {"error": f"the request body did not arrive within {self.timeout:g} s (--read-timeout)"})
            return None
        if len(body) != int(length):
            self._send(400, {"error": f"bad request: body of {len(body)} bytes, Content-Length says {length}"})
            return None
        return body

    def do_GET(self):
        if self.path.rstrip("/") != "/health":
            self._send(404, {"error": f"unknown path {self.path}; use POST /score or GET /health"})
        elif self._authorised():
            self._send(200, {"status": "ok", "reward": self.reward_name, "max_body_bytes": self.max_body})

    def do_POST(self):
        if self.path.rstrip("/") != "/score":
            self._send(404, {"error": f"unknown path {self.path}; use POST /score"})
            return
        if not self._authorised():
            return
        body = self._body()
        if body is None:
            return
        try:
            images, prompts, metadata = parse_score_request(body)
        except ValueError as e:
            self._send(400, {"error": f"bad request: {e}"})
            return
        try:
            with self.lock:                                     # reward models are rarely thread-safe
                scores, info = self.reward_fn(images, prompts, metadata)
        except ValueError as e:                                 # raised, or wrong/NaN/inf scores (CheckedReward)
            self._send(422, {"error": f"the reward failed on this input: {e}"})
            return
        self._send(200, {"scores": scores.tolist(), "info": jsonable(info)})


class _Server(ThreadingHTTPServer):
    """A threading HTTP server that handles at most ``max_connections`` connections at once (the others wait in the
    listen queue)."""

    daemon_threads = True

    def __init__(self, address, handler, max_connections: int):
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        self._slots.acquire()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def make_server(reward_fn: RewardFn, host: str = "127.0.0.1", port: int = 0, name: str = "", *,
                token: str | None = None, read_timeout: float = 30.0, max_body_bytes: int = 512 * 2**20,
                max_connections: int = 8) -> ThreadingHTTPServer:
    """An HTTP server scoring with ``reward_fn`` (not started: call ``serve_forever()``, e.g. in a thread).
    ``server.server_address`` holds the bound ``(host, port)``.

    ``token``: when set, every request needs ``Authorization: Bearer <token>`` (else 401). ``read_timeout``: seconds
    each socket read may wait (408 or a closed connection after). ``max_body_bytes``: larger bodies get 413.
    ``max_connections``: connections handled at once."""
    if token is not None and (not isinstance(token, str) or not token):
        raise ValueError(f"token must be a non-empty string or None; got {token!r}")
    for what, value in (("read_timeout (--read-timeout)", read_timeout), ("max_body_bytes (--max-body-mb)",
                        max_body_bytes), ("max_connections (--max-connections)", max_connections)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
            raise ValueError(f"{what} must be a finite number > 0; got {value!r}")
    name = name or getattr(reward_fn, "__name__", type(reward_fn).__name__)
    handler = type("RewardHandler", (_Handler,), {"reward_fn": CheckedReward(name, reward_fn), "reward_name": name,
                                                  "lock": threading.Lock(), "token": token,
                                                  "timeout": float(read_timeout), "max_body": int(max_body_bytes)})
    return _Server((host, port), handler, int(max_connections))


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__} > 0, got {text!r}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jagg.rewards.server", description="Serve a jagg reward over HTTP (POST /score, GET /health).",
        epilog="Security: the server has no TLS. Off loopback (--host 0.0.0.0 or a LAN address) anyone who can reach "
               f"the port can use it: set a token (--token or ${TOKEN_ENV}, sent by the client as reward_server.token"
               f" or ${TOKEN_ENV}) and keep it on a trusted network or behind an SSH tunnel.")
    ap.add_argument("--reward", required=True, help="a registry reward, its options in the name "
                    "(pickscore:path=/models/PickScore_v1,batch_size=16; jagg.rewards.registry), or module:function "
                    "(or module:Class) of a reward callable")
    ap.add_argument("--kwargs", default="{}", help="JSON keyword arguments for a reward class, or more options of a "
                    "registry reward")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    ap.add_argument("--port", type=int, default=8000, help="port (0 = any free port)")
    ap.add_argument("--token", default=None, help=f"shared token every request must carry (default: ${TOKEN_ENV} "
                    "if set, else none); prefer the environment variable, the command line is visible to other users")
    ap.add_argument("--read-timeout", type=_positive(float), default=30.0,
                    help="seconds each socket read may wait; then 408 or a closed connection (default: 30)")
    ap.add_argument("--max-body-mb", type=_positive(float), default=512.0,
                    help="largest request body in MiB; larger ones get 413 (default: 512)")
    ap.add_argument("--max-connections", type=_positive(int), default=8,
                    help="connections handled at once; more wait in the listen queue (default: 8)")
    args = ap.parse_args(argv)
    try:
        kwargs = json.loads(args.kwargs)
    except ValueError as e:
        ap.error(f"--kwargs is not JSON ({e}); give an object, e.g. '{{\"model_path\": \"/models/x\"}}'")
    if not isinstance(kwargs, dict):
        ap.error(f"--kwargs must be a JSON object, e.g. '{{\"model_path\": \"/models/x\"}}'; got {args.kwargs!r}")
    token = args.token or os.environ.get(TOKEN_ENV) or None
    server = make_server(load_reward(args.reward, kwargs), args.host, args.port, args.reward, token=token,
                         read_timeout=args.read_timeout, max_body_bytes=int(args.max_body_mb * 2**20),
                         max_connections=args.max_connections)
    host, port = server.server_address[:2]
    if not token and not _is_loopback(host):
        print(f"warning: serving on {host} without a token: anyone who can reach port {port} can use this reward; "
              f"set --token or ${TOKEN_ENV}", file=sys.stderr, flush=True)
    print(f"jagg reward server listening on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
