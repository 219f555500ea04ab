"""The HTTP reward client against the example server on loopback (127.0.0.1, port 0): batching, both image wire
formats, the CLI entry point, a timeout, a server error, a refused connection; model-weight rewards' errors and a
tiny random CLIP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from jagg.rewards.server import (AestheticReward, ClipScoreReward, PickScoreReward, RewardClient, RewardServerError,
                                load_reward, make_server)




def echo_reward(images, prompts, metadata=None):
    """Test reward: mean brightness + prompt length; sleeps on 'sleep', fails on 'fail'."""
    if any("fail" in p for p in prompts):
        raise ValueError("this prompt always fails")
    if any("sleep" in p for p in prompts):
        time.sleep(1.0)
    scores = images.reshape(len(images), -1).mean(1) / 255.0 + np.array([len(p) for p in prompts])
    info = {"n_chars": [len(p) for p in prompts], "tag": [m.get("tag") if m else None for m in (metadata or
                                                                                              [None] * len(prompts))],
            "batch": len(prompts)}
    return scores.astype(np.float32), info


@pytest.fixture(scope="module")
def server():
    srv = make_server(echo_reward, "127.0.0.1", 0, "echo")
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    host, port = srv.server_address[:2]
    yield f"http://{host}:{port}"
    srv.shutdown()
    srv.server_close()


def images(n=5, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, 8, 8, 3), dtype=np.uint8)


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
    assert client.health() == {"status": "ok", "reward": "echo"}


def test_timeout_names_url_and_failing_batch(server):
    client = RewardClient(server, batch_size=2, timeout=0.3, retries=1, backoff=0.0)
    with pytest.raises(RewardServerError) as e:
        client(images(4), ["a", "b", "sleep", "c"])
    msg = str(e.value)
    assert server in msg and "[2..3]" in msg and "timed out" in msg and "2 attempt(s)" in msg
    assert e.value.indices == [2, 3]


def test_server_error_is_retried_then_reported(server):
    client = RewardClient(server, batch_size=3, retries=2, backoff=0.01)
    with pytest.raises(RewardServerError) as e:
        client(images(3), ["ok", "fail", "ok"])
    msg = str(e.value)
    assert "HTTP 500" in msg and "ValueError: this prompt always fails" in msg and "[0..2]" in msg
    assert "3 attempt(s)" in msg


def test_bad_request_is_a_client_error(server):
    req = urllib.request.Request(server + "/score", data=b'{"images": 1}', method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 400 and "bad request" in json.loads(e.value.read())["error"]
    with pytest.raises(ValueError, match="images must be uint8"):
        RewardClient(server)(images(2).astype(np.float32), ["a", "b"])


def test_refused_connection():
    import socket

    with socket.socket() as s:                          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = RewardClient(f"http://127.0.0.1:{port}", retries=1, backoff=0.0, timeout=2)
    with pytest.raises(RewardServerError, match="connection error"):
        client(images(1), ["a"])


def test_cli_serves_module_function():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "jagg.rewards.server", "--reward", "test_reward_server:echo_reward",
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("jagg reward server listening on http://127.0.0.1:"), proc.stderr.read()
        url = line.rsplit(" ", 1)[-1]
        scores, _ = RewardClient(url)(images(2), ["x", "yy"])
        np.testing.assert_allclose(scores, echo_reward(images(2), ["x", "yy"])[0], rtol=1e-6)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_load_reward_errors():
    with pytest.raises(ValueError, match="module:function"):
        load_reward("jagg.rewards")
    with pytest.raises(ValueError, match="cannot load reward"):
        load_reward("jagg.rewards:NoSuchReward")


# -- rewards that need model weights ---------------------------------------------------------------------------


def test_model_rewards_without_weights_are_clear_errors(tmp_path, monkeypatch):
    for var in ("JAGG_CLIP_PATH", "JAGG_PICKSCORE_PATH", "JAGG_PICKSCORE_PROCESSOR_PATH", "JAGG_AESTHETIC_HEAD_PATH"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(FileNotFoundError, match="PickScore weights: no local path given.*yuvalkirstain/PickScore_v1"):
        PickScoreReward()
    with pytest.raises(FileNotFoundError, match="CLIP score weights: .* does not exist.*clip-vit-large-patch14"):
        ClipScoreReward(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="aesthetic head weights"):
        AestheticReward(tmp_path)


@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    import torch

    d = tmp_path_factory.mktemp("tiny_clip")
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in "abcdefghijklmnopqrstuvwxyz":
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    try:                                                # transformers >= 5 takes the vocab, 4.x reads files
        tok = transformers.CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)
    except TypeError:
        (d / "vocab.json").write_text(json.dumps(vocab))
        (d / "merges.txt").write_text("#version: 0.2\n")
        tok = transformers.CLIPTokenizer(vocab_file=str(d / "vocab.json"), merges_file=str(d / "merges.txt"),
                                         model_max_length=77)
    proc = transformers.CLIPProcessor(image_processor=transformers.CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}), tokenizer=tok)
    cfg = transformers.CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8),
        projection_dim=8)
    torch.manual_seed(0)
    transformers.CLIPModel(cfg).save_pretrained(d)
    proc.save_pretrained(d)
    head = {"layers.0.weight": torch.randn(4, 8), "layers.0.bias": torch.zeros(4),
            "layers.2.weight": torch.randn(1, 4), "layers.2.bias": torch.zeros(1)}
    torch.save(head, d / "head.pth")
    return d


def test_tiny_random_clip_rewards(tiny_clip_dir):
    ims, prompts = images(3), ["a red cube", "a blue ball", "two cats"]
    clip = ClipScoreReward(tiny_clip_dir, device="cpu")
    img, txt = clip._embed(ims, prompts)
    assert img.shape == txt.shape == (3, 8)                # projected embeddings (projection_dim), not hidden states
    s, info = clip(ims, prompts)
    assert s.shape == (3,) and s.dtype == np.float32 and np.all(np.abs(s) <= 1.0 + 1e-6)
    p, info = PickScoreReward(tiny_clip_dir, device="cpu")(ims, prompts)
    np.testing.assert_allclose(p * 26.0, info["pickscore_raw"], rtol=1e-5)
    a, _ = AestheticReward(tiny_clip_dir, tiny_clip_dir / "head.pth", device="cpu")(ims, prompts)
    assert a.shape == (3,) and np.isfinite(a).all()
