"""What a reward function returns is coerced to one float32 score per image (a generator, bools, numpy and torch
arrays) or refused with one line naming the reward and what was wrong (strings, objects, complex or non-finite
scores, too many or too few, a dict); a user's ``module:function`` reward alike in ``jagg train`` and ``jagg eval``."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from command_line import run as run_cli
from jagg.cli import main
from tiny_runs import no_eval_train_args


def _returns(value):
    return lambda images, prompts, metadata: value(len(prompts)) if callable(value) else value


@pytest.mark.parametrize("value,message", [
    (lambda n: (float(i) for i in range(n)), None),                          # a generator: coerced
    (lambda n: [True, False] * (n // 2), None),                              # bools: 1 and 0
    (lambda n: np.arange(n, dtype=np.int64), None),
    (lambda n: torch.arange(n, dtype=torch.float64), None),
    (lambda n: (x for x in iter(int, 1)), "shape (5,)"),                      # an endless generator: too many
    (lambda n: ["1.0"] * n, "must be real numbers, not strings"),
    (lambda n: [0.5] * (n - 1) + ["x"], "not strings"),
    (lambda n: [0.5] * (n - 1) + [object()], "of type object"),
    (lambda n: "0.5", "returned a str"),
    (lambda n: None, "returned a NoneType"),
    (lambda n: np.ones(n) * (1 + 2j), "complex scores"),
    (lambda n: torch.ones(n, dtype=torch.complex64), "complex scores"),
    (lambda n: [1e39] * n, "beyond float32"),
    (lambda n: [float("nan")] * n, "scores must be finite"),
    (lambda n: [0.5] * (n + 1), "one score per image"),
    (lambda n: [[0.5]] * n, "one score per image"),
    (lambda n: {"a": 1}, "returned a dict"),
])
def test_a_reward_s_return_value_is_coerced_or_refused_naming_the_reward(value, message):
    from jagg.rewards.registry import get_reward

    reward = get_reward(_returns(value))
    images = np.zeros((4, 8, 8, 3), dtype=np.uint8)
    if message is None:
        scores, info = reward(images, ["a"] * 4)
        assert scores.dtype == np.float32 and scores.shape == (4,) and info == {}
        return
    with pytest.raises(ValueError) as e:
        reward(images, ["a"] * 4)
    assert "reward '<lambda>'" in str(e.value) and message in str(e.value), e.value
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("plugin,message", [("generator", None), ("strings", "not strings"),
                                            ("complex", "complex scores")])
def test_a_user_reward_s_return_value_in_train_and_eval(plugin, message, tmp_path, tiny_ckpt, capsys, monkeypatch):
    module = types.ModuleType("user_rewards")
    module.generator = lambda images, prompts, metadata: (float(i % 3) for i in range(len(prompts)))
    module.strings = lambda images, prompts, metadata: ["0.5"] * len(prompts)
    module.complex = lambda images, prompts, metadata: np.ones(len(prompts)) * 1j
    monkeypatch.setitem(sys.modules, "user_rewards", module)
    spec = f"user_rewards:{plugin}"
    code, line, _ = run_cli(main, no_eval_train_args(tiny_ckpt, tmp_path / "run", 1, "reward.weights=null",
                                                     f"reward.name={spec}"), capsys)
    evaluated, eline, _ = run_cli(main, ["eval", "--checkpoint", tiny_ckpt, "--reward", spec, "--num-prompts", "2",
                                 "--images-per-prompt", "1", "--steps", "2"], capsys)
    if message is None:
        assert code == 0 and evaluated == 0, (line, eline)
        return
    for got, text in ((code, line), (evaluated, eline)):
        assert got == 2 and f"reward '{spec}'" in text and message in text, text
