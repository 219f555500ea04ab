"""The rewards Flow-GRPO users run, against local stand-ins on loopback: a GenEval / DeQA / UnifiedReward server
speaking Flow-GRPO's pickled protocol (``flow_grpo_remote``), an OpenAI-compatible VLM judge (``vlm_judge``) and an
OCR engine (``ocr``); malformed, slow and hostile answers fail naming the server; the restricted unpickler. A run
trained on all three: tests/test_real_train.py."""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import io
import json
import pickle
import socket
import threading
import time

import numpy as np
import pytest
from PIL import Image

from jagg.infra.config_loader import from_dict
from jagg.rewards import FlowGrpoRemote, OcrReward, RewardServerError, VlmJudge, get_reward
from jagg.rewards.ocr import levenshtein, ocr_reward
from jagg.rewards.registry import RewardError
from jagg.rewards.safe_pickle import UnsafePickleError, loads_plain
from jagg.rewards.vlm_judge import JudgeError, QUESTION
from jagg.trainers.sections import RewardSection
from flow_grpo_standins import TAGS, geneval_answer, images, jpeg_mean, judge_server, serving
from reward_plugins import StubOcr, ocr_pixels


def metadata(n):
    return [{"tag": TAGS[i % 2], "include": [{"class": "cat", "count": 1}], "prompt": f"p{i}"} for i in range(n)]


# -- flow_grpo_remote --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_geneval_server_gets_flow_grpos_request_and_its_scores_come_back(protocol):
    ims, meta = images(5), metadata(5)
    with serving(lambda *a: geneval_answer(*a, protocol=protocol)) as (url, requests):
        scores, info = get_reward(f"flow_grpo_remote:server=geneval,url={url},batch_size=2")(ims, ["x"] * 5, meta)
        sent = [pickle.loads(body) for _, _, body in requests]
        assert [len(r["images"]) for r in sent] == [2, 2, 1]           # np.array_split's even chunks, as Flow-GRPO
        assert [m for r in sent for m in r["meta_datas"]] == meta and all(r["only_strict"] is True for r in sent)
        assert set(sent[0]) == {"images", "meta_datas", "only_strict"} and requests[0][0] == "/"
        want = np.array([jpeg_mean(d) for r in sent for d in r["images"]])
        np.testing.assert_array_equal(scores, want.astype(np.float32))
        np.testing.assert_array_equal(info["strict_correct"], want > 0.5)
        assert "correct" not in info                                   # a strict-only server leaves it 0
        assert set(info["group_rewards"]) == set(TAGS) and info["group_rewards"]["colors"].tolist() == [-10.0] * 5
        full = FlowGrpoRemote(url=url, batch_size=2, only_strict=False)
        scores2, info2 = full(ims, ["x"] * 5, meta)
        assert pickle.loads(requests[-1][2])["only_strict"] is False
        np.testing.assert_array_equal(scores2, scores)
        np.testing.assert_array_equal(info2["correct"], want > 0.4)
        np.testing.assert_array_equal(info2["group_rewards"]["two_object"], np.where(
            np.arange(5) % 2 == 1, want > 0.4, -10.0))


def test_deqa_and_unifiedreward_servers_get_what_flow_grpo_sends():
    def outputs(path, headers, body):
        req = pickle.loads(body)
        return 200, pickle.dumps({"outputs": [len(p) / 10 for p in req.get("prompts", ["abc"] * len(req["images"]))]})

    with serving(outputs) as (url, requests):
        scores, info = get_reward(f"flow_grpo_remote:server=deqa,url={url}")(images(3), ["a", "bb", "ccc"], None)
        assert set(pickle.loads(requests[-1][2])) == {"images"} and info == {}
        np.testing.assert_allclose(scores, [0.3] * 3)
        scores, _ = get_reward(f"flow_grpo_remote:server=unifiedreward,url={url}")(images(3), ["a", "bb", "ccc"])
        assert pickle.loads(requests[-1][2])["prompts"] == ["a", "bb", "ccc"]
        np.testing.assert_allclose(scores, [0.1, 0.2, 0.3])
        n = len(requests)
        for fn in (get_reward(f"flow_grpo_remote:server=deqa,url={url}"), OcrReward(engine=StubOcr()),
                   VlmJudge(base_url=url, probe=False)):
            scores, _ = fn(images(0), [])                                     # a process with nothing to score
            assert scores.shape == (0,) and scores.dtype == np.float32
        assert len(requests) == n


def test_a_config_names_the_remote_reward_with_its_options():
    """``reward: {name: ...}`` and a weighted sum take it; wrong options are refused at load, naming them."""
    section = from_dict(RewardSection, {"weights": {"flow_grpo_remote:url=http://127.0.0.1:9,timeout=5": 1.0,
                                                    "jpeg_compressibility": 0.1}}, "reward")
    assert section.weights
    for spec, culprit in (("flow_grpo_remote:server=unifiedreward", "url= is required"),
                          ("flow_grpo_remote:server=clip", "server must be one of"),
                          ("flow_grpo_remote:url=ftp://x", "url must start with http"),
                          ("flow_grpo_remote:retries=-1", "retries must be"),
                          ("flow_grpo_remote:tiemout=3", r"unknown option\(s\) \['tiemout'\]"),
                          ("vlm_judge:concurrency=0", "concurrency must be"),
                          ("vlm_judge:base_url=localhost", "base_url must start with http")):
        with pytest.raises(ValueError, match=f"reward.name: reward '{spec.split(':')[0]}.*{culprit}"):
            from_dict(RewardSection, {"name": spec}, "reward")
    with pytest.raises(ValueError, match="server=geneval needs each prompt's GenEval metadata.*jsonl"):
        FlowGrpoRemote(url="http://127.0.0.1:9", probe=False)(images(1), ["a"], None)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_is_not_up_is_found_when_the_reward_is_built():
    """Before a model loads (the trainer builds its reward first): nothing at the URL, a judge that refuses the key or
    does not serve the model. A server that only takes POST (GenEval's Flask app: 405/501 to a GET) is up."""
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(ValueError, match=f"flow_grpo_remote \\(server=deqa\\): nothing answers at {url} .*probe=false"):
        get_reward(f"flow_grpo_remote:server=deqa,url={url}")
    with pytest.raises(ValueError, match=f"vlm_judge: nothing answers at {url}/v1/models"):
        get_reward(f"vlm_judge:base_url={url}/v1")
    get_reward(f"vlm_judge:base_url={url}/v1,probe=false")                # the first batch will find out
    models = {"object": "list", "data": [{"id": "Qwen2-VL"}, {"id": "UnifiedReward-7b-v1.5"}]}

    def listing(path, headers):
        if headers.get("Authorization") != "Bearer flowgrpo":
            return 401, b'{"error": "bad key"}'
        return (200, json.dumps(models).encode()) if path == "/v1/models" else (404, b"")

    with serving(lambda *a: (200, b""), get=listing) as (url, _):
        FlowGrpoRemote(server="deqa", url=url)                              # a 401 is an answer: it is up
        VlmJudge(base_url=url + "/v1", api_key="flowgrpo")
        with pytest.raises(ValueError, match=r"model 'UnifiedReward-7b-v2' is not served .*\['Qwen2-VL', 'Unif"):
            VlmJudge(base_url=url + "/v1", api_key="flowgrpo", model="UnifiedReward-7b-v2")
        with pytest.raises(ValueError, match=r"refused the API key \(HTTP 401\).*OPENAI_API_KEY"):
            VlmJudge(base_url=url + "/v1", api_key="wrong")


def _marker_pickle(marker) -> bytes:
    class Hostile:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').close()",)
    return pickle.dumps({"scores": [1.0], "x": Hostile()})


def test_a_hostile_answer_is_refused_by_name_and_its_code_never_runs(tmp_path):
    marker = tmp_path / "ran"
    hostile = _marker_pickle(marker)
    with serving(lambda *a: (200, hostile)) as (url, requests):
        with pytest.raises(RewardServerError) as e:
            FlowGrpoRemote(server="deqa", url=url, retries=2, backoff=0)(images(1), ["a"])
    assert url in str(e.value) and "builtins.exec, which is refused" in str(e.value)
    assert len(requests) == 1 and not marker.exists()                  # not retried; nothing ran
    with pytest.raises(UnsafePickleError, match="builtins.exec"):
        loads_plain(hostile)
    assert not marker.exists()


@pytest.mark.parametrize("answer, cause", [
    ((200, b"<html>busy</html>"), "not a plain pickle"),
    ((200, pickle.dumps([1.0])), "a pickled list, not a dict"),
    ((200, pickle.dumps({"outputs": [1.0, 2.0]})), r"'outputs' must be 1 finite numbers"),
    ((200, pickle.dumps({"outputs": [float("nan")]})), r"'outputs' must be 1 finite numbers"),
    ((200, pickle.dumps({"outputs": ["0.5"]})), r"'outputs' must be 1 finite numbers"),
    ((200, pickle.dumps({"scores": [1.0]})), r"no 'outputs' in the answer \(its keys: \['scores'\]\)"),
    ((200, pickle.dumps({"outputs": np.array(["a"])})), "numpy dtype"),
    ((400, b"bad request"), "HTTP 400: bad request"),
])
def test_malformed_answers_fail_naming_the_server_and_are_not_retried(answer, cause):
    with serving(lambda *a: answer) as (url, requests):
        with pytest.raises(RewardServerError, match=f"reward server {url} failed on batch samples.*{cause}"):
            FlowGrpoRemote(server="deqa", url=url, retries=2, backoff=0)(images(1), ["a"])
        assert len(requests) == 1


def test_a_server_traceback_is_retried_and_its_last_line_shown():
    trace = b"Traceback (most recent call last):\n  File \"app.py\"\nKeyError: 'tag'\n"
    with serving(lambda *a: (500, trace)) as (url, requests):
        with pytest.raises(RewardServerError, match=f"{url} .* after 2 attempt.*HTTP 500: KeyError: 'tag'"):
            FlowGrpoRemote(server="deqa", url=url, retries=1, backoff=0)(images(1), ["a"])
        assert len(requests) == 2


def test_a_slow_server_times_out_naming_the_url():
    def slow(*a):
        time.sleep(0.6)
        return 200, pickle.dumps({"outputs": [1.0]})

    with serving(slow) as (url, _):                 # the answer would have come (after 0.6 s): the deadline failed it
        with pytest.raises(RewardServerError, match=f"{url} .*timed out after 0.2 s"):
            FlowGrpoRemote(server="deqa", url=url, timeout=0.2, retries=0)(images(1), ["a"])


# -- the restricted unpickler ------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_plain_data_and_numeric_arrays_load_under_every_protocol(protocol):
    value = {"a": [1, 2.5, None, True, "s", b"b", (1,)], "arr": np.arange(6, dtype=np.float32).reshape(2, 3),
             "fortran": np.asfortranarray(np.ones((2, 3))), "bools": np.array([True, False]),
             "scalars": [np.float64(0.25), np.int64(3), np.bool_(True)], "set": {1, 2}}
    got = loads_plain(pickle.dumps(value, protocol=protocol))
    assert got["a"] == value["a"] and got["scalars"] == [0.25, 3, True] and got["set"] == {1, 2}
    for key in ("arr", "fortran", "bools"):
        np.testing.assert_array_equal(got[key], value[key])
        assert got[key].dtype == value[key].dtype


@pytest.mark.parametrize("value, refused", [
    (np.array([{"a": 1}], dtype=object), "dtype"), (np.array(["text"]), "dtype"), (np.array([1 + 2j]), "dtype"),
    (threading.Lock, "_thread"), (contextlib.nullcontext(), "contextlib.nullcontext"), (json.loads, "json.loads")])
def test_anything_else_is_refused_by_name(value, refused):
    with pytest.raises(UnsafePickleError, match=refused):
        loads_plain(pickle.dumps(value))


class _Reduces:
    def __init__(self, *reduced):
        self.reduced = reduced

    def __reduce__(self):
        return self.reduced


def test_numpys_names_cannot_allocate_a_huge_array():
    """numpy.ndarray is only a name for numpy's own array pickles: called with a shape it fails, and _reconstruct
    takes only numpy's empty start (the data must come from the pickle's bytes)."""
    with pytest.raises(TypeError):
        loads_plain(pickle.dumps(_Reduces(np.ndarray, ((10**12,),))))
    reconstruct = np.zeros(1).__reduce__()[0]
    with pytest.raises(UnsafePickleError, match=r"shape \(1000000000000,\)"):
        loads_plain(pickle.dumps(_Reduces(reconstruct, (np.ndarray, (10**12,), b"b"))))


# -- vlm_judge ---------------------------------------------------------------------------------------------------


def test_the_judge_asks_unifiedrewards_question_and_parses_its_score(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "flowgrpo")
    answer, state = judge_server(lambda p: f"The image is fine.\nFinal Score: {p[-1]}.5 and later Final Score: 1",
                                 delay=0.05)
    with serving(answer) as (url, requests):
        fn = get_reward(f"vlm_judge:base_url={url}/v1,concurrency=2,image_size=32")
        scores, info = fn(images(5), ["cat 1", "dog 2", "fox 3", "owl 4", "cow 1"])
        np.testing.assert_allclose(scores, [0.3, 0.5, 0.7, 0.9, 0.3], rtol=1e-6)
        np.testing.assert_allclose(info["judge_score"], [1.5, 2.5, 3.5, 4.5, 1.5], rtol=1e-6)
        assert len(requests) == 5 and state["most"] <= 2
        (path, headers, body), = [r for r in requests if b"Text Caption: [cat 1]" in r[2]]   # sent concurrently
        req = json.loads(body)
        assert path == "/v1/chat/completions" and headers["Authorization"] == "Bearer flowgrpo"
        assert req["model"] == "UnifiedReward-7b-v1.5" and req["temperature"] == 0
        image, question = req["messages"][0]["content"]
        assert question == {"type": "text", "text": QUESTION.format(prompt="cat 1")}
        assert image["image_url"]["url"].startswith("data:image;base64,")
        png = Image.open(io.BytesIO(base64.b64decode(image["image_url"]["url"].split(",", 1)[1])))
        assert png.format == "PNG" and png.size == (32, 32)


def test_an_answer_without_a_score_is_an_error_naming_the_sample_not_a_zero():
    answer, _ = judge_server(lambda p: "Final Score: 4" if p != "bad" else "I cannot judge this image.")
    with serving(answer) as (url, _):
        with pytest.raises(RewardError, match=r"sample 1 \(prompt 'bad'\): the answer has no 'Final Score.*not a 0"):
            get_reward(f"vlm_judge:base_url={url}/v1,image_size=0")(images(3), ["ok", "bad", "ok"])


@pytest.mark.parametrize("answer, cause", [((401, b'{"error": "wrong key"}'), "HTTP 401: wrong key"),
                                           ((200, b'{"choices": []}'), "not a chat completion")])
def test_judge_failures_name_the_endpoint_and_sample(answer, cause):
    with serving(lambda *a: answer) as (url, requests):
        with pytest.raises(JudgeError, match=f"{url}/v1/chat/completions: sample 0 .*1 attempt.*{cause}"):
            VlmJudge(base_url=url + "/v1", retries=3, backoff=0)(images(1), ["a"])
        assert len(requests) == 1


def test_a_slow_judge_times_out():
    answer, _ = judge_server(lambda p: "Final Score: 3", delay=0.6)
    with serving(answer) as (url, _):
        with pytest.raises(JudgeError, match="sample 0 .*timed out after 0.2 s"):
            VlmJudge(base_url=url + "/v1", timeout=0.2, retries=0)(images(1), ["a"])


# -- ocr ---------------------------------------------------------------------------------------------------------


def test_ocr_reward_as_flow_grpo_computes_it():
    fn = get_reward("ocr:engine=reward_plugins:StubOcr")
    cases = [  # (lines the engine reads, prompt, reward)
        ([("Hello World", 1)], 'a sign that says "Hello World"', 1.0),
        ([("the sign says hello", 1), ("WORLD!", 1)], 'a sign "Hello World" at dusk', 1.0),  # contained, no spaces
        ([("helo world", 1)], 'a neon sign "Hello World"', 1 - 1 / 10),
        ([("Hello", 1), ("zzzzzzzzzz", 0)], 'text "Hello World"', 1 - 5 / 10),           # confidence 0 ignored
        ([("qqqqqqqqqqqqqqqqqqqqqqq", 1)], 'text "abc"', 0.0),                            # capped at len(target)
        ([], 'only one quote "ab c', 0.0),                                                  # split('"')[1]
    ]
    ims = np.stack([ocr_pixels(lines, side=32) for lines, _, _ in cases])
    scores, info = fn(ims, [p for _, p, _ in cases])
    np.testing.assert_allclose(scores, [r for _, _, r in cases], atol=1e-7)
    assert info["ocr_text"][1] == "thesignsayshelloworld!" and info["ocr_distance"].tolist() == [0, 0, 1, 5, 3, 3]


def test_levenshtein_and_the_reward_formula():
    assert [levenshtein(a, b) for a, b in (("kitten", "sitting"), ("", "abc"), ("flaw", "lawn"), ("ab", "ab"))] == \
        [3, 3, 2, 0]
    assert ocr_reward("H e L L o", "hello") == (1.0, 0) and ocr_reward("", "ab") == (0.0, 2)


def test_ocr_refusals_name_the_sample():
    fn = OcrReward(engine=StubOcr())
    ok = ocr_pixels([("a", 1)])
    with pytest.raises(ValueError, match=r"sample 1: prompt 'no quotes here' has no text in double quotes"):
        fn(np.stack([ok, ok]), ['"a"', "no quotes here"])
    with pytest.raises(ValueError, match=r"sample 0: prompt 'an empty \" \" quote' quotes no text"):
        fn(ok[None], ['an empty " " quote'])
    broken = ok.copy()
    broken[-1, -1] = (1, 2, 3)
    with pytest.raises(RuntimeError, match=r"sample 1: the OCR engine failed \(RuntimeError: engine crashed\)"):
        fn(np.stack([ok, broken]), ['"a"', '"a"'])


@pytest.mark.skipif(importlib.util.find_spec("paddleocr") is not None, reason="PaddleOCR is installed here")
def test_a_missing_ocr_engine_is_refused_at_load_with_the_install_command():
    with pytest.raises(ValueError, match=r"reward.name: reward 'ocr'.*not installed.*pip install 'jagg\[ocr\]'"):
        from_dict(RewardSection, {"name": "ocr"}, "reward")
    with pytest.raises(ValueError, match=r"pip install 'jagg\[ocr\]'"):
        get_reward("ocr")
    with pytest.raises(ValueError, match="engine must be 'paddleocr' or 'package.module:attribute'"):
        from_dict(RewardSection, {"name": "ocr:engine=tesseract"}, "reward")
