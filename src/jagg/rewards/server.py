"""A reward server: serve any jagg reward callable over HTTP, plus rewards that need model weights.

Every jagg reward is a callable ``(images uint8 [N, H, W, 3], prompts list[str], metadata list[dict] | None) ->
(scores float32 [N], info dict)``. This server scores ``POST /score`` requests with one (wire format:
:mod:`jagg.rewards.protocol`); :class:`jagg.rewards.RewardClient` is the matching reward callable for the trainer.
Serve any reward callable (``module:function``; a class is instantiated with ``--kwargs``)::

    python -m jagg.rewards.server --reward jagg.shapes.geneval:GenevalReward --port 8000
    python -m jagg.rewards.server --reward jagg.rewards.server:PickScoreReward \\
        --kwargs '{"model_path": "/models/PickScore_v1", "processor_path": "/models/CLIP-ViT-H-14"}'

The server prints ``jagg reward server listening on http://HOST:PORT`` once ready (``--port 0`` picks a free port).
It binds to 127.0.0.1 unless ``--host`` says otherwise. Answers: 200 with the scores; 400 naming the wrong or
missing field of a bad request; 401 without the token (``--token`` or ``$JAGG_REWARD_TOKEN``); 408 when the body
does not arrive within ``--read-timeout`` seconds; 411/413 without a Content-Length or over ``--max-body-mb``; 422
when the reward raised or returned wrong scores (wrong count, NaN, inf) on this input. Calls to the reward are
serialised (models are rarely thread-safe); at most ``--max-connections`` requests are handled at once.

Rewards needing model weights (:class:`ClipScoreReward`, :class:`PickScoreReward`, :class:`AestheticReward`) load
them from local paths only; a missing path is an error naming what to download, never a silent zero.
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
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .images import to_uint8
from .protocol import TOKEN_ENV, auth_header, decode_images, jsonable
from .registry import CheckedReward

RewardFn = Callable[..., tuple]
_MOVED = {"RewardClient": "jagg.rewards.client", "RewardServerError": "jagg.rewards.client",
          "encode_images": "jagg.rewards.protocol", "decode_images": "jagg.rewards.protocol",
          "IMAGE_FORMATS": "jagg.rewards.protocol"}


def __getattr__(name: str):
    if name in _MOVED:
        raise ImportError(f"{name} moved from jagg.rewards.server to {_MOVED[name]}: import it from there "
                          f"(RewardClient and RewardServerError also from jagg.rewards)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------------------------
# server
# ----------------------------------------------------------------------------------------------------------------


def load_reward(spec: str, kwargs: dict | None = None) -> RewardFn:
    """``"module:attr"`` -> a reward callable. A class is instantiated with ``kwargs``; a function is used as is."""
    if ":" not in spec:
        raise ValueError(f"reward must be 'module:function' (e.g. jagg.shapes.geneval:GenevalReward); got {spec!r}")
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
    ap.add_argument("--reward", required=True, help="module:function (or module:Class) of the reward callable")
    ap.add_argument("--kwargs", default="{}", help="JSON keyword arguments for a reward class")
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


# ----------------------------------------------------------------------------------------------------------------
# rewards that need model weights (local paths only)
# ----------------------------------------------------------------------------------------------------------------


def require_local_model(path: str | os.PathLike | None, what: str, download: str) -> Path:
    """``path`` as a Path if it is an existing local model directory/file; otherwise a clear error."""
    if not path:
        raise FileNotFoundError(f"{what}: no local path given. jagg never downloads weights: on a machine with "
                                f"internet run `{download}`, copy the result here and pass its path")
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{what}: {p} does not exist. jagg never downloads weights: on a machine with "
                                f"internet run `{download}`, copy the result here and pass its path")
    return p


class _ClipBase:
    """Shared CLIP loading and embedding (transformers ``CLIPModel`` + ``CLIPProcessor`` from local directories)."""

    def __init__(self, model_path, processor_path=None, device: str = "auto", dtype: str = "fp32", *, what: str,
                 download: str):
        import torch
        from transformers import AutoProcessor, CLIPModel

        mp = require_local_model(model_path, what, download)
        pp = require_local_model(processor_path or model_path, what + " processor", download)
        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                   ("cpu" if device == "auto" else device))
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        self.processor = AutoProcessor.from_pretrained(str(pp), local_files_only=True)
        self.model = CLIPModel.from_pretrained(str(mp), local_files_only=True).to(self.device, self.dtype).eval()

    def _embed(self, images: np.ndarray, prompts: Sequence[str] | None):
        import torch

        with torch.no_grad():
            pix = self.processor(images=list(to_uint8(images)), return_tensors="pt")["pixel_values"]
            img = self.model.get_image_features(pixel_values=pix.to(self.device, self.dtype))
            img = getattr(img, "pooler_output", img)
            img = torch.nn.functional.normalize(img.float(), dim=-1)
            if prompts is None:
                return img, None
            tok = self.processor(text=list(prompts), padding=True, truncation=True, return_tensors="pt")
            txt = self.model.get_text_features(input_ids=tok["input_ids"].to(self.device),
                                               attention_mask=tok["attention_mask"].to(self.device))
            txt = getattr(txt, "pooler_output", txt)
            return img, torch.nn.functional.normalize(txt.float(), dim=-1)


class ClipScoreReward(_ClipBase):
    """CLIP score: cosine similarity of the image and prompt embeddings, in [-1, 1].

    ``model_path``: a local ``openai/clip-vit-large-patch14`` (or any CLIPModel) directory; the processor is read
    from ``processor_path`` (default: the same directory). Default path: ``$JAGG_CLIP_PATH``.
    """

    def __init__(self, model_path=None, processor_path=None, device="auto", dtype="fp32"):
        super().__init__(model_path or os.environ.get("JAGG_CLIP_PATH"), processor_path, device, dtype,
                         what="CLIP score weights",
                         download="huggingface-cli download openai/clip-vit-large-patch14 --local-dir <dir>")

    def __call__(self, images, prompts, metadata=None):
        img, txt = self._embed(images, prompts)
        cos = (img * txt).sum(-1)
        return cos.cpu().numpy().astype(np.float32), {"clip_cosine": cos.cpu().numpy()}


class PickScoreReward(_ClipBase):
    """PickScore (Kirstain et al. 2023): ``logit_scale * cos(image, prompt) / normalize`` (Flow-GRPO divides by 26).

    ``model_path``: local ``yuvalkirstain/PickScore_v1``; ``processor_path``: local
    ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` (its processor). Defaults: ``$JAGG_PICKSCORE_PATH``,
    ``$JAGG_PICKSCORE_PROCESSOR_PATH``.
    """

    def __init__(self, model_path=None, processor_path=None, device="auto", dtype="fp32", normalize: float = 26.0):
        super().__init__(model_path or os.environ.get("JAGG_PICKSCORE_PATH"),
                         processor_path or os.environ.get("JAGG_PICKSCORE_PROCESSOR_PATH"), device, dtype,
                         what="PickScore weights",
                         download="huggingface-cli download yuvalkirstain/PickScore_v1 --local-dir <dir> (and "
                                  "laion/CLIP-ViT-H-14-laion2B-s32B-b79K for the processor)")
        self.normalize = float(normalize)

    def __call__(self, images, prompts, metadata=None):
        img, txt = self._embed(images, prompts)
        raw = self.model.logit_scale.detach().exp().float() * (img * txt).sum(-1)
        return (raw / self.normalize).cpu().numpy().astype(np.float32), {"pickscore_raw": raw.cpu().numpy()}


class AestheticReward(_ClipBase):
    """LAION aesthetic predictor v2: an MLP on normalised CLIP ViT-L/14 image embeddings (prompt-free), ~1-10.

    ``model_path``: local ``openai/clip-vit-large-patch14``; ``head_path``: the MLP weights
    ``sac+logos+ava1-l14-linearMSE.pth`` (keys ``layers.{0,2,4,6,7}.{weight,bias}``). Defaults: ``$JAGG_CLIP_PATH``,
    ``$JAGG_AESTHETIC_HEAD_PATH``.
    """

    def __init__(self, model_path=None, head_path=None, processor_path=None, device="auto", dtype="fp32"):
        import torch

        head = require_local_model(head_path or os.environ.get("JAGG_AESTHETIC_HEAD_PATH"), "aesthetic head weights",
                                   "wget https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/"
                                   "sac+logos+ava1-l14-linearMSE.pth")
        super().__init__(model_path or os.environ.get("JAGG_CLIP_PATH"), processor_path, device, dtype,
                         what="aesthetic CLIP weights",
                         download="huggingface-cli download openai/clip-vit-large-patch14 --local-dir <dir>")
        state = torch.load(head, map_location="cpu", weights_only=True)
        layers = sorted({int(k.split(".")[1]) for k in state if k.startswith("layers.")})
        if not layers:
            raise ValueError(f"{head} is not an aesthetic-predictor state dict (no 'layers.N.weight' keys)")
        mods: dict[int, torch.nn.Module] = {}
        for i in range(max(layers) + 1):
            if i in layers:
                w = state[f"layers.{i}.weight"]
                mods[i] = torch.nn.Linear(w.shape[1], w.shape[0])
            else:
                mods[i] = torch.nn.Dropout(0.0)
        self.head = torch.nn.Sequential(*[mods[i] for i in range(max(layers) + 1)])
        self.head.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()})
        self.head.to(self.device).eval()

    def __call__(self, images, prompts=None, metadata=None):
        import torch

        img, _ = self._embed(images, None)
        with torch.no_grad():
            s = self.head(img).squeeze(-1)
        return s.cpu().numpy().astype(np.float32), {}


if __name__ == "__main__":
    sys.exit(main())
