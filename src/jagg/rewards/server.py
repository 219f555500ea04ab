"""Rewards over HTTP: a client with the reward-callable signature, a small server, and model-weight rewards.

Every jagg reward is a callable ``(images uint8 [N, H, W, 3] np.ndarray, prompts list[str], metadata list[dict] |
None) -> (scores np.float32 [N], info dict)``. :class:`RewardClient` is one too: it sends the batch, in chunks, to
a reward server (a GPU box running PickScore, an OCR model, a VLM judge, ...) and returns what the server scored.

Protocol (JSON in, JSON out)::

    POST /score   {"images": {"format": "png" | "npy", "data": [base64 PNG, ...] | base64 of one .npy [n,H,W,3]},
                   "prompts": [...], "metadata": [...] | null}
              ->  200 {"scores": [n floats], "info": {...}}       or   4xx/5xx {"error": "..."}
    GET  /health  -> 200 {"status": "ok", "reward": "<name>"}

Serve any reward callable (``module:function``; a class is instantiated with ``--kwargs``)::

    python -m jagg.rewards.server --reward jagg.rewards:GenevalReward --port 8000
    python -m jagg.rewards.server --reward jagg.rewards.server:PickScoreReward \\
        --kwargs '{"model_path": "/models/PickScore_v1", "processor_path": "/models/CLIP-ViT-H-14"}'

The server prints ``jagg reward server listening on http://HOST:PORT`` once ready (``--port 0`` picks a free port).
It binds to 127.0.0.1 unless ``--host`` says otherwise.

Rewards needing model weights (:class:`ClipScoreReward`, :class:`PickScoreReward`, :class:`AestheticReward`) load
them from local paths only; a missing path is an error naming what to download, never a silent zero.
"""

from __future__ import annotations

import argparse
import base64
import importlib
import inspect
import io
import json
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

RewardFn = Callable[..., tuple]
IMAGE_FORMATS = ("png", "npy")


# ----------------------------------------------------------------------------------------------------------------
# wire format
# ----------------------------------------------------------------------------------------------------------------


def _as_uint8(images) -> np.ndarray:
    """uint8 ``[N, H, W, 3]`` from a uint8 array, or a float array / torch tensor ``[N, 3, H, W]`` in [-1, 1]."""
    if hasattr(images, "detach"):                                  # torch tensor, channels first, [-1, 1]
        images = images.detach().float().cpu().numpy()
        images = np.transpose(images, (0, 2, 3, 1))
        images = (np.clip(images / 2 + 0.5, 0, 1) * 255).round().astype(np.uint8)
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be uint8 [N, H, W, 3]; got shape {images.shape}")
    if images.dtype != np.uint8:
        raise ValueError(f"images must be uint8 [N, H, W, 3]; got dtype {images.dtype}")
    return images


def encode_images(images: np.ndarray, fmt: str = "png") -> dict:
    """uint8 ``[n, H, W, 3]`` -> the JSON ``images`` field."""
    if fmt == "png":
        from PIL import Image

        data = []
        for im in images:
            buf = io.BytesIO()
            Image.fromarray(im).save(buf, format="PNG")
            data.append(base64.b64encode(buf.getvalue()).decode("ascii"))
        return {"format": "png", "data": data}
    if fmt == "npy":
        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(images), allow_pickle=False)
        return {"format": "npy", "data": base64.b64encode(buf.getvalue()).decode("ascii")}
    raise ValueError(f"image format must be one of {IMAGE_FORMATS}; got {fmt!r}")


def decode_images(payload: dict) -> np.ndarray:
    """The JSON ``images`` field -> uint8 ``[n, H, W, 3]``."""
    if not isinstance(payload, dict) or payload.get("format") not in IMAGE_FORMATS:
        raise ValueError(f"'images' must be {{'format': one of {IMAGE_FORMATS}, 'data': ...}}")
    if payload["format"] == "npy":
        arr = np.load(io.BytesIO(base64.b64decode(payload["data"])), allow_pickle=False)
    else:
        from PIL import Image

        arr = np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(d))).convert("RGB"))
                        for d in payload["data"]])
    return _as_uint8(arr)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if hasattr(x, "detach"):
        return x.detach().cpu().tolist()
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


# ----------------------------------------------------------------------------------------------------------------
# client
# ----------------------------------------------------------------------------------------------------------------


class RewardServerError(RuntimeError):
    """A batch could not be scored: names the server URL, the failing sample indices and the last cause."""

    def __init__(self, url: str, indices: Sequence[int], cause: str, attempts: int):
        self.url, self.indices, self.cause = url, list(indices), cause
        span = f"{self.indices[0]}..{self.indices[-1]}" if self.indices else "-"
        super().__init__(f"reward server {url} failed on batch samples [{span}] ({len(self.indices)} images) after "
                         f"{attempts} attempt(s): {cause}")


class _Retryable(Exception):
    pass


@dataclass
class RewardClient:
    """Reward callable that scores images on an HTTP reward server.

    Call: ``(images uint8 [N, H, W, 3] (or a float tensor [N, 3, H, W] in [-1, 1]), prompts list[str],
    metadata list[dict] | None) -> (scores np.float32 [N], info dict)``. Per-sample info lists of the chunks are
    concatenated (numeric ones as arrays); other info values are collected per chunk in a list.
    """

    url: str = field(metadata={"help": "Server base URL, e.g. http://127.0.0.1:8000 (POST <url>/score)."})
    batch_size: int = field(default=32, metadata={"help": "Images per request."})
    timeout: float = field(default=120.0, metadata={"help": "Seconds to wait for one request."})
    retries: int = field(default=3, metadata={"help": "Extra attempts after a timeout, connection error or 5xx/429."})
    backoff: float = field(default=1.0, metadata={"help": "Seconds before the first retry; doubles each retry."})
    image_format: str = field(default="png", metadata={"help": f"Wire format of the images, one of {IMAGE_FORMATS} "
                              "(png: lossless and ~3x smaller; npy: no encoding cost)."})
    concurrency: int = field(default=1, metadata={"help": "Requests in flight at once."})

    def __post_init__(self):
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"reward server url must start with http:// or https://; got {self.url!r}")
        self.url = self.url.rstrip("/")
        if self.batch_size < 1 or self.concurrency < 1 or self.retries < 0:
            raise ValueError("batch_size and concurrency must be >= 1 and retries >= 0")
        if self.timeout <= 0 or self.backoff < 0:
            raise ValueError("timeout must be > 0 and backoff >= 0")
        if self.image_format not in IMAGE_FORMATS:
            raise ValueError(f"image_format must be one of {IMAGE_FORMATS}; got {self.image_format!r}")

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=self.timeout) as r:
            return json.loads(r.read())

    def _post(self, body: bytes) -> dict:
        req = urllib.request.Request(self.url + "/score", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                raw = r.read()
            try:
                return json.loads(raw)
            except ValueError as e:
                raise RuntimeError(f"bad response: not JSON ({raw[:100]!r})") from e
        except urllib.error.HTTPError as e:
            try:
                msg = json.loads(e.read()).get("error", "")
            except Exception:                                   # noqa: BLE001 - any unparsable body
                msg = ""
            text = f"HTTP {e.code}: {msg or e.reason}"
            if e.code >= 500 or e.code == 429:
                raise _Retryable(text) from e
            raise RuntimeError(text) from e                     # a client error: retrying cannot help
        except (TimeoutError, socket.timeout) as e:
            raise _Retryable(f"timed out after {self.timeout:g} s") from e
        except urllib.error.URLError as e:
            if isinstance(e.reason, (TimeoutError, socket.timeout)):
                raise _Retryable(f"timed out after {self.timeout:g} s") from e
            raise _Retryable(f"connection error: {e.reason}") from e
        except (ConnectionError, OSError) as e:
            raise _Retryable(f"connection error: {e}") from e

    def _score_chunk(self, images: np.ndarray, prompts: list, metadata: list | None, indices: range) -> dict:
        body = json.dumps({"images": encode_images(images, self.image_format), "prompts": list(prompts),
                           "metadata": _jsonable(metadata)}).encode()
        cause, attempt = "", 0
        for attempt in range(1, self.retries + 2):
            try:
                out = self._post(body)
            except _Retryable as e:
                cause = str(e)
                if attempt <= self.retries:
                    time.sleep(self.backoff * 2 ** (attempt - 1))
                continue
            except RuntimeError as e:
                raise RewardServerError(self.url, indices, str(e), attempt) from e
            scores = out.get("scores") if isinstance(out, dict) else None
            if not isinstance(scores, list) or len(scores) != len(indices):
                raise RewardServerError(self.url, indices, f"bad response: expected 'scores' with {len(indices)} "
                                        f"values, got {str(out)[:200]}", attempt)
            return out
        raise RewardServerError(self.url, indices, cause, attempt)

    def __call__(self, images, prompts: Sequence[str], metadata: Sequence[dict] | None = None):
        images = _as_uint8(images)
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


# ----------------------------------------------------------------------------------------------------------------
# server
# ----------------------------------------------------------------------------------------------------------------


def load_reward(spec: str, kwargs: dict | None = None) -> RewardFn:
    """``"module:attr"`` -> a reward callable. A class is instantiated with ``kwargs``; a function is used as is."""
    if ":" not in spec:
        raise ValueError(f"reward must be 'module:function' (e.g. jagg.rewards:GenevalReward); got {spec!r}")
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


class _Handler(BaseHTTPRequestHandler):
    server_version = "jagg-reward/1"
    reward_fn: RewardFn
    reward_name: str
    lock: threading.Lock

    def log_message(self, fmt, *args):                          # quiet; errors are returned to the client
        pass

    def _send(self, code: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):        # the client gave up (timeout)
            pass

    def do_GET(self):
        if self.path.rstrip("/") == "/health":
            self._send(200, {"status": "ok", "reward": self.reward_name})
        else:
            self._send(404, {"error": f"unknown path {self.path}; use POST /score or GET /health"})

    def do_POST(self):
        if self.path.rstrip("/") != "/score":
            self._send(404, {"error": f"unknown path {self.path}; use POST /score"})
            return
        try:
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            images = decode_images(req["images"])
            prompts = req["prompts"]
            if not isinstance(prompts, list) or len(prompts) != len(images):
                raise ValueError(f"'prompts' must be a list of {len(images)} strings")
        except Exception as e:                                  # noqa: BLE001 - malformed request
            self._send(400, {"error": f"bad request: {e}"})
            return
        try:
            with self.lock:                                     # reward models are rarely thread-safe
                scores, info = self.reward_fn(images, prompts, req.get("metadata"))
            scores = np.asarray(scores, dtype=np.float32).reshape(-1)
            if scores.shape[0] != len(images):
                raise ValueError(f"reward returned {scores.shape[0]} scores for {len(images)} images")
            self._send(200, {"scores": scores.tolist(), "info": _jsonable(info or {})})
        except Exception as e:                                  # noqa: BLE001 - report, keep serving
            self._send(500, {"error": f"{type(e).__name__}: {e}"})


def make_server(reward_fn: RewardFn, host: str = "127.0.0.1", port: int = 0, name: str = "") -> ThreadingHTTPServer:
    """An HTTP server scoring with ``reward_fn`` (not started: call ``serve_forever()``, e.g. in a thread).
    ``server.server_address`` holds the bound ``(host, port)``."""
    handler = type("RewardHandler", (_Handler,), {"reward_fn": staticmethod(reward_fn),
                                                  "reward_name": name or getattr(reward_fn, "__name__", "reward"),
                                                  "lock": threading.Lock()})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jagg.rewards.server", description="Serve a jagg reward over HTTP.")
    ap.add_argument("--reward", required=True, help="module:function (or module:Class) of the reward callable")
    ap.add_argument("--kwargs", default="{}", help="JSON keyword arguments for a reward class")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    ap.add_argument("--port", type=int, default=8000, help="port (0 = any free port)")
    args = ap.parse_args(argv)
    reward = load_reward(args.reward, json.loads(args.kwargs))
    server = make_server(reward, args.host, args.port, args.reward)
    host, port = server.server_address[:2]
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
            pix = self.processor(images=list(_as_uint8(images)), return_tensors="pt")["pixel_values"]
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
