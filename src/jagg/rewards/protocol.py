"""The reward server's wire format, shared by :mod:`jagg.rewards.client` and :mod:`jagg.rewards.server`.

JSON in, JSON out (standard JSON: no NaN or Infinity)::

    POST /score   {"images": {"format": "png" | "npy", "data": [base64 PNG, ...] | base64 of one .npy [n,H,W,3]},
                   "prompts": [n strings], "metadata": [n entries] | null}
              ->  200 {"scores": [n finite numbers], "info": {...}}    or    4xx/5xx {"error": "..."}
    GET  /health  -> 200 {"status": "ok", "reward": "<name>", "max_body_bytes": <int>}

A server started with a token wants the header ``Authorization: Bearer <token>`` on every request.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from typing import Any

import numpy as np

from .images import to_uint8

IMAGE_FORMATS = ("png", "npy")
TOKEN_ENV = "JAGG_REWARD_TOKEN"                                 # the shared token, for the server and the client


def auth_header(token: str) -> str:
    """The ``Authorization`` header value that carries ``token``."""
    return f"Bearer {token}"


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


def _b64(text: Any, where: str) -> bytes:
    if not isinstance(text, str):
        raise ValueError(f"'{where}' must be a base64 string; got {type(text).__name__}")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"'{where}' is not valid base64: {e}") from None


def decode_images(payload: Any) -> np.ndarray:
    """The JSON ``images`` field -> uint8 ``[n, H, W, 3]``; a ValueError names the field that is wrong."""
    if not isinstance(payload, dict) or payload.get("format") not in IMAGE_FORMATS or "data" not in payload:
        raise ValueError(f"'images' must be {{'format': one of {list(IMAGE_FORMATS)}, 'data': ...}}; got "
                         f"{str(payload)[:80]}")
    data = payload["data"]
    if payload["format"] == "npy":
        try:
            arr = np.load(io.BytesIO(_b64(data, "images.data")), allow_pickle=False)
        except (ValueError, EOFError, OSError) as e:
            raise ValueError(f"'images.data' is not a .npy array: {type(e).__name__}: {e}") from None
    else:
        from PIL import Image

        if not isinstance(data, list) or not data:
            raise ValueError("'images.data' must be a non-empty list of base64 PNGs for format 'png'")
        frames = []
        for i, d in enumerate(data):
            try:
                frames.append(np.asarray(Image.open(io.BytesIO(_b64(d, f"images.data[{i}]"))).convert("RGB")))
            except (OSError, Image.DecompressionBombError) as e:     # UnidentifiedImageError is an OSError
                raise ValueError(f"'images.data[{i}]' is not an image: {e}") from None
        if len({f.shape for f in frames}) > 1:
            raise ValueError(f"'images.data' holds images of different sizes: {sorted({f.shape for f in frames})}")
        arr = np.stack(frames)
    try:
        return to_uint8(arr)
    except ValueError as e:
        raise ValueError(f"'images': {e}") from None


def jsonable(x: Any) -> Any:
    """``x`` as standard JSON values: arrays and tensors as lists, NaN and infinities as ``null``."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, np.generic):
        return jsonable(x.item())
    if hasattr(x, "detach"):
        return jsonable(x.detach().cpu().tolist())
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    return str(x)


def bad_scores(scores: Any, n: int) -> str | None:
    """Why ``scores`` is not ``n`` finite numbers (naming the items), or None when it is."""
    if not isinstance(scores, list) or len(scores) != n:
        return f"expected 'scores' as a list of {n} numbers; got {str(scores)[:200]}"
    bad = [i for i, s in enumerate(scores)
           if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s)]
    if bad:
        return (f"scores must be finite numbers; items {bad[:10]}{' ...' if len(bad) > 10 else ''} are "
                f"{[scores[i] for i in bad[:10]]}")
    return None
