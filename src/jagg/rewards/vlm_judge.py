"""A vision-language model as the judge, through an OpenAI-compatible endpoint: UnifiedReward as Flow-GRPO runs it.

Registered as ``vlm_judge`` (:mod:`jagg.rewards.registry`). Flow-GRPO serves UnifiedReward-7b-v1.5 with sglang
(``python -m sglang.launch_server --model-path CodeGoat24/UnifiedReward-7b-v1.5 --api-key flowgrpo --port 17140
--chat-template chatml-llava``; vLLM's ``vllm serve`` speaks the same API) and asks it, for each image, one chat
completion (``POST <base_url>/chat/completions``, temperature 0): the image (resized to 512 x 512, a PNG data URL)
and UnifiedReward's point-wise question with the prompt as the caption (:data:`QUESTION`). The score is the first
number after ``Final Score:`` (1 to 5, :data:`SCORE`) divided by 5. An answer without one is an error naming the
sample and quoting the text, never a 0 (Flow-GRPO scores it 0, which trains towards whatever broke the judge).

Requests go out ``concurrency`` at a time (a thread pool); each ends within ``timeout`` seconds and a timeout, a
connection error, a broken answer or a 5xx/429 is retried ``retries`` times with backoff. The API key (sglang's
``--api-key``) is ``api_key`` or ``$OPENAI_API_KEY``; prefer the environment variable, every checkpoint saves the
config.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from ..checks import check_count
from .client import RequestFailed, _Final, _Retryable, check_seconds, check_url, http_request, probe_server, retried
from .images import to_uint8

API_KEY_ENV = "OPENAI_API_KEY"
# UnifiedReward's point-wise image-generation question, word for word as Flow-GRPO sends it: the judge was trained on
# this wording, so another one changes the reward.
QUESTION = (
    "<image>\nYou are given a text caption and a generated image based on that caption. Your task is to evaluate this "
    "image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with the "
    "provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as described in "
    "the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail "
    "preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria, assign a score from 1 "
    "to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]")
SCORE = re.compile(r"Final Score:\s*([1-5](?:\.\d+)?)")     # the first match; the reward is its number / 5


class JudgeError(RuntimeError):
    """The judge could not score a sample: names the endpoint, the sample and the cause."""


def image_url(image: np.ndarray, size: int) -> str:
    """uint8 ``[H, W, 3]`` -> the PNG data URL of the image resized to ``size`` x ``size`` (0: as it is)."""
    im = Image.fromarray(image)
    if size:
        im = im.resize((size, size))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def judged_score(text) -> float | None:
    """The reward in a judge's answer ``text`` (the number after ``Final Score:`` / 5), or None when there is none."""
    match = SCORE.search(text) if isinstance(text, str) else None
    return float(match.group(1)) / 5.0 if match else None


@dataclass
class VlmJudge:
    """Reward callable: a VLM judge's score of each image against its prompt (module docstring)."""

    base_url: str = field(default="http://127.0.0.1:17140/v1", metadata={"help": "The OpenAI-compatible API's base "
                          "URL (Flow-GRPO's sglang: http://127.0.0.1:17140/v1)."})
    model: str = field(default="UnifiedReward-7b-v1.5", metadata={"help": "The model name the server serves."})
    api_key: str | None = field(default=None, repr=False, metadata={"help": "The server's API key (sglang "
                                f"--api-key); null: ${API_KEY_ENV} if set, else none."})
    concurrency: int = field(default=16, metadata={"help": "Requests in flight at once."})
    timeout: float = field(default=120.0, metadata={"help": "Seconds one request may take in all."})
    retries: int = field(default=3, metadata={"help": "Extra attempts after a timeout, connection error, broken "
                                                      "answer or 5xx/429."})
    backoff: float = field(default=1.0, metadata={"help": "Seconds before the first retry; doubles each retry."})
    image_size: int = field(default=512, metadata={"help": "Images are resized to this square before judging "
                                                           "(Flow-GRPO: 512); 0 sends them as they are."})
    max_tokens: int = field(default=0, metadata={"help": "The answer's token limit; 0 leaves it to the server (as "
                                                         "Flow-GRPO)."})
    probe: bool = field(default=True, metadata={"help": "When the reward is built (before the model loads), ask "
                        "<base_url>/models whether the server answers, takes the key and serves model; false: the "
                        "first batch finds out."})

    @classmethod
    def check_options(cls, options: dict) -> None:
        """The spec's options checked at config load (nothing is sent)."""
        cls(**{**options, "probe": False})

    def __post_init__(self):
        self.base_url = check_url(self.base_url, "base_url")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be the served model's name; got {self.model!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError(f"api_key must be a non-empty string or null (null: ${API_KEY_ENV} if set)")
        self.concurrency = check_count(self.concurrency, "concurrency")
        self.retries = check_count(self.retries, "retries", 0)
        self.image_size = check_count(self.image_size, "image_size", 0)
        self.max_tokens = check_count(self.max_tokens, "max_tokens", 0)
        self.timeout = check_seconds(self.timeout, "timeout")
        self.backoff = check_seconds(self.backoff, "backoff", positive=False)
        if not isinstance(self.probe, bool):
            raise ValueError(f"probe must be true or false; got {self.probe!r}")
        if self.probe:
            self.check_server()

    def headers(self) -> dict:
        key = self.api_key or os.environ.get(API_KEY_ENV)
        return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def check_server(self) -> None:
        """``GET <base_url>/models``: a ValueError when nothing answers, the key is refused (401/403) or the list of
        served models lacks ``model``; a server without that list passes."""
        status, raw = probe_server(self.base_url, "/models", self.headers(), self.timeout, "vlm_judge")
        if status in (401, 403):
            raise ValueError(f"vlm_judge: {self.base_url}/models refused the API key (HTTP {status}); give the "
                             f"server's key (sglang --api-key) as ${API_KEY_ENV} or api_key=")
        try:
            served = [m["id"] for m in json.loads(raw)["data"]] if status == 200 else None
        except (ValueError, KeyError, TypeError):
            served = None
        if served is not None and self.model not in served:
            raise ValueError(f"vlm_judge: model {self.model!r} is not served at {self.base_url}; it serves {served} "
                             "(set model=)")

    @property
    def endpoint(self) -> str:
        return self.base_url + "/chat/completions"

    def request(self, image: np.ndarray, prompt: str) -> dict:
        """The chat-completion request that asks the judge about one image."""
        content = [{"type": "image_url", "image_url": {"url": image_url(image, self.image_size)}},
                   {"type": "text", "text": QUESTION.format(prompt=prompt)}]
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "temperature": 0}
        if self.max_tokens:
            body["max_tokens"] = self.max_tokens
        return body

    def _post(self, body: bytes) -> str:
        status, raw = http_request(self.endpoint, "POST", "", body, self.headers(), self.timeout)
        try:
            out = json.loads(raw)
        except ValueError:
            out = None
        if not 200 <= status < 300:
            msg = out.get("error", out) if isinstance(out, dict) else raw[:300]
            raise (_Retryable if status >= 500 or status == 429 else _Final)(f"HTTP {status}: {str(msg)[:300]}")
        try:
            return out["choices"][0]["message"]["content"]
        except (TypeError, KeyError, IndexError):
            raise _Final(f"bad response: not a chat completion with choices[0].message.content: "
                         f"{raw[:200]!r}") from None

    def judge(self, i: int, image: np.ndarray, prompt: str) -> tuple[float, str]:
        """Sample ``i``'s ``(reward, the judge's text)``; a :class:`JudgeError` names the sample."""
        body = json.dumps(self.request(image, prompt)).encode()
        where = f"vlm_judge {self.endpoint}: sample {i} (prompt {prompt[:80]!r})"
        try:
            text, attempts = retried(lambda: self._post(body), self.retries, self.backoff)
        except RequestFailed as e:
            raise JudgeError(f"{where} failed after {e.attempts} attempt(s): {e.cause}") from e
        score = judged_score(text)
        if score is None:
            raise JudgeError(f"{where}: the answer has no 'Final Score: <1 to 5>', so it has no score (not a 0): "
                             f"{str(text)[:300]!r}")
        return score, text

    def __call__(self, images, prompts, metadata=None) -> tuple[np.ndarray, dict]:
        images = to_uint8(images)
        if len(prompts) != len(images):
            raise ValueError(f"got {len(images)} images and {len(prompts)} prompts")
        pool = ThreadPoolExecutor(self.concurrency)
        try:
            futures = [pool.submit(self.judge, i, im, p) for i, (im, p) in enumerate(zip(images, prompts))]
            results = [f.result() for f in futures]
        finally:
            pool.shutdown(wait=True, cancel_futures=True)   # on an error the queued samples are not sent
        scores = np.array([r[0] for r in results], dtype=np.float32)
        return scores, {"judge_score": scores * 5}
