"""`python -m lab plateau` on constructed paired-seed runs: each pair against its own
reference, the paired contrast of the plateau gaps, a predicted rate set against the measured one, and its refusals."""

import json

import pytest

from constructed_runs import constructed_run, exact_curve

from lab import plateau_mechanism as pm

RISING = lambda i, stretch=1.0: exact_curve(i, stretch=10.0 * stretch)        # 0.001 per iteration, never level
CURVES = {"exact": RISING, "slow": lambda i: RISING(i, 2.0), "low": lambda i: exact_curve(i, top=0.68),
          "flat": exact_curve}


@pytest.fixture
def out(tmp_path):
    for variant, curve in CURVES.items():
        for seed in range(3):
            d = tmp_path / "out" / variant / f"seed{seed}"
            d.mkdir(parents=True)
            (d / "result.json").write_text(json.dumps(constructed_run(variant, seed, curve, offset=0.01 * seed)))
    return tmp_path / "out"


def test_pairs_contrasts_and_a_prediction(out, tmp_path, capsys):
    path = tmp_path / "rec.json"
    assert pm.main(["--out", str(out), "--seeds", "3", "--pair", "slow:exact", "--pair", "low:flat",
                    "--predict", "slow:exact=0.5:0.4:0.6", "--predict", "low:flat=0.25", "--json", str(path)]) == 0
    slow, low = json.loads(path.read_text())
    assert slow["pair"] == "slow - exact" and slow["rate"] == pytest.approx(0.5)
    assert slow["plateau_gap"] == pytest.approx(-0.029) and slow["lag_gap"] == pytest.approx(-0.029)
    assert slow["gap_minus_baseline"] == 0.0                        # the first pair is the contrasts' baseline
    assert slow["predicted_rate"] == 0.5 and slow["rate_inside"] and slow["gap_inside"]
    assert slow["predicted_gap"] == pytest.approx(-0.029)           # the lag of the predicted rate
    assert slow["predicted_gap_lo"] < slow["predicted_gap"] < slow["predicted_gap_hi"]
    # a curve that rises as fast and levels off 0.02 lower than its reference: its gap is no lag
    assert low["rate"] == pytest.approx(1.0) and low["plateau_gap"] == pytest.approx(-0.02)
    assert low["gap_minus_baseline"] == pytest.approx(-0.02 + 0.029)
    assert low["gap_minus_baseline_lo"] == pytest.approx(low["gap_minus_baseline"])   # paired: no seed spread
    assert not low["rate_inside"] and not low["gap_inside"]         # a rate of 0.25 predicts a lag it does not have
    text = capsys.readouterr().out
    assert "OUTSIDE" in text and "inside" in text and "slow - exact" in text
    with pytest.raises(ValueError, match="exists; pass --overwrite"):   # a record is never overwritten unasked
        pm.main(["--out", str(out), "--seeds", "3", "--pair", "slow:exact", "--json", str(path)])


def test_a_range_is_judged_by_overlap_and_unknown_by_nothing(out, tmp_path, capsys):
    """The meter's answer is a range (jagg bench meter's rate/update) or unknown: a range is inside where it
    overlaps the measured interval, and its gap runs between the lags of its two ends; unknown is not judged."""
    path = tmp_path / "rec.json"
    assert pm.main(["--out", str(out), "--seeds", "3", "--pair", "slow:exact", "--pair", "low:flat",
                    "--pair", "flat:exact", "--predict", "slow:exact=0.3:0.55", "--predict", "low:flat=0.2:0.4",
                    "--predict", "flat:exact=unknown", "--json", str(path)]) == 0
    slow, low, flat = json.loads(path.read_text())
    assert slow["predicted_rate"] is None and (slow["predicted_rate_lo"], slow["predicted_rate_hi"]) == (0.3, 0.55)
    assert slow["rate_inside"] and slow["gap_inside"]                # 0.5 measured lies in [0.3, 0.55]
    assert slow["predicted_gap_lo"] < slow["plateau_gap"] < slow["predicted_gap_hi"]
    assert not low["rate_inside"]                                    # 1.0 measured: no overlap
    assert low["predicted_gap_hi"] == pytest.approx(0.0) and low["gap_inside"]   # flat has levelled by 0.4 x its end
    assert flat["predicted_rate"] == "unknown" and flat["rate_inside"] is None and flat["gap_inside"] is None
    text = capsys.readouterr().out
    assert "[0.300, 0.550]: inside" in text and "unknown: no judgement" in text


@pytest.mark.parametrize("args, message", [
    (["--pair", "slow"], "VARIANT:REFERENCE"),
    (["--pair", "slow:slow"], "two different"),
    (["--pair", "slow:exact", "--predict", "slow:exact=abc"], "RATE, LO:HI"),
    (["--pair", "slow:exact", "--predict", "slow:exact=0.1:0.2:0.3:0.4"], "RATE, LO:HI"),
    (["--pair", "slow:exact", "--predict", "slow:exact=0.6:0.5"], "LO <= RATE <= HI"),
    (["--pair", "slow:exact", "--predict", "slow=0.5"], "VARIANT:REFERENCE"),
    (["--pair", "slow:exact", "--predict", "slow:exact=0.5:0.6:0.7"], "LO <= RATE <= HI"),
    (["--pair", "slow:exact", "--predict", "slow:exact=-1"], r"\(0, 10\]"),
    (["--pair", "slow:exact", "--predict", "slow:flat=0.5"], "no --pair compares"),
    (["--pair", "slow:missing"], "unfinished runs"),
    (["--pair", "slow:exact", "--seeds", "1"], "--seeds must be >= 2"),
])
def test_bad_input_is_refused_by_name(out, args, message):
    with pytest.raises(ValueError, match=message):
        pm.main(["--out", str(out), *args] if "--seeds" in args else ["--out", str(out), "--seeds", "3", *args])


def test_an_undefined_measured_rate_is_never_judged(tmp_path, capsys):
    """Two flat curves: no gain to read a rate from, so the measured rate is undefined (it was NaN, and a prediction
    was judged OUTSIDE it): the table says undefined, the prediction gets no judgement, the JSON holds null."""
    for variant in ("flat_a", "flat_b"):
        for seed in range(3):
            d = tmp_path / "out" / variant / f"seed{seed}"
            d.mkdir(parents=True)
            (d / "result.json").write_text(json.dumps(constructed_run(variant, seed, lambda i: 0.5, offset=0.01 * seed)))
    path = tmp_path / "rec.json"
    assert pm.main(["--out", str(tmp_path / "out"), "--seeds", "3", "--pair", "flat_b:flat_a",
                    "--predict", "flat_b:flat_a=0.5", "--json", str(path)]) == 0
    (rec,) = json.loads(path.read_text())
    assert rec["rate"] is None and rec["rate_lo"] is None and rec["rate_inside"] is None
    text = capsys.readouterr().out
    assert "OUTSIDE" not in text and "no judgement" in text and "undefined" in text and "nan" not in text
