"""The HTTP reward client and server on loopback (127.0.0.1, port 0, real sockets): batching, both image wire
formats, image inputs as local rewards take them, the CLI entry point, whole-request deadlines, broken answers from
a raw socket server (trickling, truncated, not HTTP), scores that are not finite, rewards that fail, bad requests,
tokens, body-size limits, read timeouts and bounded connections. Registry rewards served by name (the preference
models on a tiny random CLIP): tests/test_preference_rewards.py."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from jagg.rewards import RewardClient, RewardServerError
from jagg.rewards.protocol import TOKEN_ENV
from jagg.rewards.server import load_reward, make_server
from jagg.rewards.images import to_uint8
from jagg.infra.config_loader import from_dict
from reward_plugins import echo_reward


@contextlib.contextmanager
def serving(reward=echo_reward, **kwargs):
    srv = make_server(reward, "127.0.0.1", 0, "echo", **kwargs)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    host, port = srv.server_address[:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def server():
    with serving() as url:
        yield url


def _read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
    while length and len(body) < length[0]:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


@contextlib.contextmanager
def raw_server(answer):
    """A bare TCP server on loopback: reads each HTTP request, then writes ``answer`` (bytes, or a list of byte
    strings sent 0.1 s apart) and closes. Yields ``(url, requests)``, requests counting the connections."""
    listener = socket.create_server(("127.0.0.1", 0))
    requests = []

    def handle(conn):
        with conn:
            _read_request(conn)
            try:
                for i, part in enumerate([answer] if isinstance(answer, bytes) else answer):
                    time.sleep(0.1 if i else 0.0)
                    conn.sendall(part)
            except OSError:                                 # the client gave up
                pass

    def accept():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            requests.append(1)
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", requests
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()


def http_answer(body: bytes, status: str = "200 OK") -> bytes:
    return (f"HTTP/1.0 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() \
        + body


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/score", data=body, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read(), parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))


def images(n=5, seed=0, side=8):
    return np.random.default_rng(seed).integers(0, 256, (n, side, side, 3), dtype=np.uint8)


@pytest.mark.parametrize("fmt", ["png", "npy"])
def test_client_batches_and_matches_local_call(server, fmt):
    ims, prompts = images(), ["a", "bb", "ccc", "dddd", "eeeee"]
    meta = [{"tag": i} for i in range(5)]
    client = RewardClient(server, batch_size=2, image_format=fmt, concurrency=2)
    scores, info = client(ims, prompts, meta)
    want, _ = echo_reward(ims, prompts, meta)
    assert scores.dtype == np.float32 and scores.shape == (5,)
    np.testing.assert_allclose(scores, want, rtol=1e-6)
    np.testing.assert_array_equal(info["n_chars"], [1, 2, 3, 4, 5])
    assert info["tag"].tolist() == [0, 1, 2, 3, 4]
    assert info["batch"] == [2, 2, 1]                   # per-request values are kept per request
    assert client.health() == {"status": "ok", "reward": "echo", "max_body_bytes": 512 * 2**20}


def test_images_are_read_as_local_rewards_read_them(server):
    """uint8 torch [N, H, W, 3] is pixels (as numpy); a float tensor [N, 3, H, W] is in [-1, 1]; uint8 [N, 3, H, W]
    is refused, not read as [-1, 1]."""
    ims, prompts = images(2), ["a", "b"]
    client = RewardClient(server)
    want = client(ims, prompts)[0]
    np.testing.assert_array_equal(client(torch.from_numpy(ims), prompts)[0], want)
    x = torch.linspace(-1, 1, 2 * 3 * 8 * 8).reshape(2, 3, 8, 8)
    np.testing.assert_array_equal(client(x, prompts)[0], client(to_uint8(x), prompts)[0])
    with pytest.raises(ValueError, match=r"images must be uint8 \[N, H, W, 3\].*uint8 \(2, 3, 8, 8\)"):
        client(torch.from_numpy(ims).permute(0, 3, 1, 2), prompts)
    with pytest.raises(ValueError, match="images must be uint8"):
        client(ims.astype(np.float32), prompts)


def test_timeout_names_url_and_failing_batch(server):
    client = RewardClient(server, batch_size=2, timeout=0.3, retries=1, backoff=0.0)
    with pytest.raises(RewardServerError) as e:
        client(images(4), ["a", "b", "sleep", "c"])
    msg = str(e.value)
    assert server in msg and "[2..3]" in msg and "timed out" in msg and "2 attempt(s)" in msg
    assert e.value.indices == [2, 3]


def test_timeout_is_a_deadline_for_the_whole_request():
    """An answer trickling in one byte per 0.1 s (3 s in all) under timeout=0.5: each read is quick, the request is
    not; health() names the URL too."""
    body = b'{"scores": [1.0]}' + b" " * 13
    with raw_server([http_answer(body)[:-30]] + [bytes([b]) for b in body[-30:]]) as (url, requests):
        client = RewardClient(url, timeout=0.5, retries=0)
        t0 = time.monotonic()
        with pytest.raises(RewardServerError, match="timed out after 0.5 s"):
            client(images(1), ["a"])
        assert time.monotonic() - t0 < 1.5
        with pytest.raises(RewardServerError, match=f"reward server {url} failed.*GET /health: timed out"):
            client.health()
        assert time.monotonic() - t0 < 2.5


@pytest.mark.parametrize("answer, cause", [(http_answer(b'{"scores": [1.0]}')[:-5], "IncompleteRead"),
                                           (b"SSH-2.0-OpenSSH_9.6\r\n", "BadStatusLine"),
                                           (http_answer(b'{"error": "overloaded"}', "503 Busy"), "HTTP 503: overloaded")])
def test_broken_answers_are_retried_and_name_the_url(answer, cause):
    """A body shorter than its Content-Length, a non-HTTP service on the port, a 5xx: a RewardServerError naming the
    URL, after the retries."""
    with raw_server(answer) as (url, requests):
        with pytest.raises(RewardServerError) as e:
            RewardClient(url, retries=2, backoff=0.0, timeout=2)(images(1), ["a"])
    assert url in str(e.value) and cause in str(e.value) and "3 attempt(s)" in str(e.value) and len(requests) == 3


@pytest.mark.parametrize("scores", [b"[NaN, 1.0]", b"[1.0, Infinity]", b"[null, null]", b'["1", 2]', b"[1.0]",
                                    b'[1, 2], "info": [3]'])
def test_scores_that_are_not_finite_numbers_are_refused(scores):
    with raw_server(http_answer(b'{"scores": ' + scores + b"}")) as (url, requests):
        with pytest.raises(RewardServerError, match=f"reward server {url} .*1 attempt.*bad response"):
            RewardClient(url, retries=2, backoff=0.0, timeout=2)(images(2), ["a", "b"])
    assert len(requests) == 1                           # the same answer would come again


def test_server_refuses_to_send_non_finite_scores(server):
    status, out = post(server, _score_body(images(2), ["a", "nan"]))
    assert status == 422 and "returned nan at batch index 1" in out["error"]
    with pytest.raises(RewardServerError, match="HTTP 422: the reward failed on this input.*nan at batch index 1"):
        RewardClient(server)(images(2), ["a", "nan"])


def _score_body(ims, prompts) -> bytes:
    from jagg.rewards.protocol import encode_images

    return json.dumps({"images": encode_images(ims, "png"), "prompts": prompts}).encode()


def test_reward_failure_is_422_and_not_retried(server):
    client = RewardClient(server, batch_size=3, retries=2, backoff=5.0)
    t0 = time.monotonic()
    with pytest.raises(RewardServerError) as e:
        client(images(3), ["ok", "fail", "ok"])
    msg = str(e.value)
    assert "HTTP 422: the reward failed on this input" in msg and "ValueError: this prompt always fails" in msg
    assert server in msg and "[0..2]" in msg and "1 attempt(s)" in msg and time.monotonic() - t0 < 2


@pytest.mark.parametrize("body, says", [
    (b"[1, 2]", "must be a JSON object"),
    (b"{not json", "the body is not JSON"),
    (b'{"prompts": ["a"]}', "missing field(s) ['images']"),
    (b'{"images": 1, "prompts": ["a"]}', "'images' must be {'format'"),
    (b'{"images": {"format": "png", "data": ["!!"]}, "prompts": ["a"]}', "'images.data[0]' is not valid base64"),
    (b'{"images": {"format": "png", "data": "abc"}, "prompts": ["a"]}', "'images.data' must be a non-empty list"),
    (b'{"images": {"format": "png", "data": ["aGk="]}, "prompts": ["a"]}', "'images.data[0]' is not an image"),
    (b'{"images": {"format": "npy", "data": ""}, "prompts": []}', "'images.data' is not a .npy array"),
    (None, "'prompts' must be a list of 2 strings"),
])
def test_bad_requests_name_the_field(server, body, says):
    if body is None:
        body = _score_body(images(2), ["only one"])
    status, out = post(server, body)
    assert status == 400 and says in out["error"], out


def test_body_limit_token_and_cli_errors():
    with serving(max_body_bytes=2000, token="s3cret") as url:
        with pytest.raises(RewardServerError, match="after 1 attempt.*HTTP 401: missing or wrong token"):
            RewardClient(url, retries=2, backoff=5.0)(images(1), ["a"])
        with pytest.raises(RewardServerError, match=f"{url} failed after 1 attempt.*HTTP 401"):
            RewardClient(url, token="wrong").health()
        assert RewardClient(url, token="s3cret")(images(1), ["a"])[0].shape == (1,)
        with pytest.raises(RewardServerError, match="HTTP 413: request body of .* over this server's limit of 2000 "
                                                    "bytes.*reward_server.batch_size"):
            RewardClient(url, token="s3cret", image_format="npy")(images(4, side=64), ["a"] * 4)
        listener = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        with listener:                                      # a huge Content-Length: 413 at once, nothing read
            listener.sendall(b"POST /score HTTP/1.1\r\nAuthorization: Bearer s3cret\r\nContent-Length: "
                             b"1000000000000\r\n\r\n")
            assert b"413" in listener.recv(4096).split(b"\r\n")[0]
    with pytest.raises(ValueError, match="max_connections .* must be a finite number > 0; got 0"):
        make_server(echo_reward, max_connections=0)


def test_read_timeout_and_bounded_connections():
    """With one connection slot, a stalled body holds it until the 0.3 s read timeout answers 408; the next request
    waits in the listen queue meanwhile, then is served."""
    with serving(read_timeout=0.3, max_connections=1) as url:
        stalled = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        stalled.settimeout(3)
        with stalled:
            stalled.sendall(b"POST /score HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
            time.sleep(0.05)
            t0 = time.monotonic()
            scores, _ = RewardClient(url, timeout=5)(images(1), ["a"])
            waited = time.monotonic() - t0
            answer = stalled.recv(4096)
        assert answer.startswith(b"HTTP/1.0 408") and b"--read-timeout" in answer
        assert 0.2 < waited < 3 and scores.shape == (1,)


def test_client_config_is_checked_and_hides_the_token(monkeypatch):
    client = from_dict(RewardClient, {"url": "http://h:1/", "batch_size": 4, "timeout": 10, "retries": 0,
                                      "backoff": 0, "image_format": "npy", "concurrency": 2, "token": "s3cret"})
    assert client.url == "http://h:1" and "s3cret" not in repr(client)
    for kwargs, culprit in (({"batch_size": 0}, "batch_size"), ({"timeout": float("nan")}, "timeout"),
                            ({"retries": 1.5}, "retries"), ({"image_format": "jpg"}, "image_format"),
                            ({"token": ""}, "token"), ({"url": "h:1"}, "url")):
        with pytest.raises(ValueError, match=culprit):
            RewardClient(**{"url": "http://h:1", **kwargs})


def test_refused_connection():
    with socket.socket() as s:                          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = RewardClient(f"http://127.0.0.1:{port}", retries=1, backoff=0.0, timeout=2)
    with pytest.raises(RewardServerError, match="connection error"):
        client(images(1), ["a"])


def test_cli_serves_module_function_with_a_token_from_the_environment(monkeypatch):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
               **{TOKEN_ENV: "s3cret"})
    proc = subprocess.Popen([sys.executable, "-m", "jagg.rewards.server", "--reward", "reward_plugins:echo_reward",
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("jagg reward server listening on http://127.0.0.1:"), proc.stderr.read()
        url = line.rsplit(" ", 1)[-1]
        with pytest.raises(RewardServerError, match="HTTP 401"):
            RewardClient(url)(images(2), ["x", "yy"])
        monkeypatch.setenv(TOKEN_ENV, "s3cret")
        scores, _ = RewardClient(url)(images(2), ["x", "yy"])
        np.testing.assert_allclose(scores, echo_reward(images(2), ["x", "yy"])[0], rtol=1e-6)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    bad = subprocess.run([sys.executable, "-m", "jagg.rewards.server", "--reward", "x:y", "--read-timeout", "0"],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "--read-timeout: expected a float > 0, got '0'" in bad.stderr


def test_load_reward_errors():
    with pytest.raises(ValueError, match="registry name .* or 'module:function'"):
        load_reward("jagg.rewards")
    with pytest.raises(ValueError, match="cannot load reward"):
        load_reward("jagg.rewards:NoSuchReward")
    with pytest.raises(ValueError, match=r"option\(s\) \['path'\] are given both"):
        load_reward("pickscore:path=/a", {"path": "/b"})
