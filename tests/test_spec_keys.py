"""A key given twice in a ``NAME:KEY=VALUE,...`` spec is refused by the one spec parser (jagg.checks.parse_spec),
wherever a spec is taken: an estimator (``bench meter --estimator``, ``--by-interval``), a cost structure
(``--cost``), a reward; the last value was silently kept."""

from __future__ import annotations

import pytest

from command_line import refused
from jagg.bench import meter_command as bench_meter
from jagg.checks import parse_spec
from jagg.cli import main


def test_the_parser_refuses_a_repeated_key_and_keeps_brackets_whole():
    assert parse_spec("r:correction_probs=[0.4,0.1],window=5", "--estimator") == (
        "r", {"correction_probs": "[0.4,0.1]", "window": "5"})
    with pytest.raises(ValueError, match=r"--estimator 'w:window=4,window=5': option 'window' is given twice"):
        parse_spec("w:window=4,window=5", "--estimator")
    with pytest.raises(ValueError, match="option 'window' is given twice"):
        parse_spec("w: window=4 , window =4", "--estimator")                    # the same value twice too


@pytest.mark.parametrize("argv,culprit", [
    (["--estimator", "w:window=4,window=5"], "--estimator 'w:window=4,window=5': option 'window' is given twice"),
    (["--by-interval", "w:window=4,correction_p=0.1,window=2"], "option 'window' is given twice"),
    (["--cost", "flow_grpo_sd35:B_F=2,B_F=3"], "option 'B_F' is given twice"),
    (["--set", "reward.name=geneval:scale=1,scale=2"], "'scale' is given twice"),
])
def test_a_key_given_twice_in_any_spec_is_refused_before_any_work(argv, culprit, capsys, monkeypatch):
    monkeypatch.setattr(bench_meter, "measure", lambda *a, **k: pytest.fail("measured before the specs' checks"))
    refused(main, ["bench", "meter", "--quick", *argv], capsys, culprit)
