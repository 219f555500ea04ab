"""Stand-ins on loopback for the reward servers Flow-GRPO users run (tests/test_flow_grpo_rewards.py,
tests/test_real_train.py): an HTTP server in a thread with a given answer, a GenEval server's pickled answer, an
OpenAI-compatible VLM judge."""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from PIL import Image

TAGS = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]


@contextlib.contextmanager
def serving(answer, get=None):
    """An HTTP server on 127.0.0.1 (a thread) answering every POST with ``answer(path, headers, body) -> (status,
    bytes)`` and every GET with ``get(path, headers)`` (None: 501, as a server that takes POST only); yields ``(url,
    requests)``, each POST a ``(path, headers, body)``. Handlers end by themselves."""
    requests: list = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            requests.append((self.path, dict(self.headers), body))
            status, out = answer(self.path, self.headers, body)
            self.send_response(status)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            try:
                self.wfile.write(out)
            except OSError:                                      # the client gave up (a timeout test)
                pass

        def do_GET(self):
            if get is None:
                self.send_error(501)
                return
            status, out = get(self.path, self.headers)
            self.send_response(status)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()


def images(n, seed=0, side=8):
    return np.random.default_rng(seed).integers(0, 256, (n, side, side, 3), dtype=np.uint8)


def jpeg_mean(data: bytes) -> float:
    return float(np.asarray(Image.open(io.BytesIO(data), formats=["jpeg"])).mean() / 255)


def geneval_answer(path, headers, body, protocol=pickle.DEFAULT_PROTOCOL):
    """A GenEval server's answer (reward-server's app_geneval.py shape): the score is the JPEG's mean pixel, correct
    when it is over 0.5, the groups per tag with -10 for another tag's images; numpy values, as servers send them."""
    req = pickle.loads(body)
    scores = [np.float64(jpeg_mean(d)) for d in req["images"]]
    strict = np.array([s > 0.5 for s in scores], dtype=np.float64)
    rewards = [0.0] * len(scores) if req["only_strict"] else [float(s > 0.4) for s in scores]
    groups = {t: [r if m["tag"] == t else -10.0 for r, m in zip(rewards, req["meta_datas"])] for t in TAGS}
    out = {"scores": scores, "rewards": rewards, "strict_rewards": strict, "group_rewards": groups,
           "group_strict_rewards": {t: np.array(v) for t, v in groups.items()}}
    return 200, pickle.dumps(out, protocol=protocol)


def judge_server(reply, delay=0.0):
    """An OpenAI-compatible chat-completions stand-in: ``reply(prompt) -> text``; counts requests in flight."""
    state = {"in_flight": 0, "most": 0}
    lock = threading.Lock()

    def answer(path, headers, body):
        req = json.loads(body)
        text = req["messages"][0]["content"][1]["text"]
        with lock:
            state["in_flight"] += 1
            state["most"] = max(state["most"], state["in_flight"])
        time.sleep(delay)
        with lock:
            state["in_flight"] -= 1
        prompt = text[text.rindex("Text Caption: [") + 15:-1]
        return 200, json.dumps({"choices": [{"message": {"role": "assistant", "content": reply(prompt)}}]}).encode()
    return answer, state
