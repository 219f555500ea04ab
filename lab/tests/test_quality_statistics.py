"""The rate and the plateau of `python -m lab quality`, on constructed curves (no training): the rising-phase efficiency,
the plateau gap, the reward at an equal budget, their intervals, and the cases where a figure is undefined."""

import math

import numpy as np
import pytest

from lab import statistics as st
from jagg.cost import PRESETS
from lab.quality_compare import compare
from lab.quality_report import RATE_COLUMNS, rate_rows
from jagg.bench.common import table
from constructed_runs import constructed_run, exact_curve


def compared(curves, seeds=(0, 1, 2), offsets=None, **kw):
    """``compare`` of variants ``{name: (curve, per_iter, rows)}`` (exact first), each seed shifted alike in every
    variant by its offset (paired)."""
    offsets = offsets or {s: 0.01 * s for s in seeds}
    runs = [constructed_run(v, s, c, p, r, offsets[s]) for s in seeds for v, (c, p, r) in curves.items()]
    return {r["variant"]: r for r in compare(runs, list(curves), list(seeds), "cpu", "test", bootstrap=300, **kw)}


EXACT = (exact_curve, 1.0, 8)


def test_identical_curves_give_a_rate_of_1_and_no_gap():
    out = compared({"exact": EXACT, "same": EXACT})
    for v in ("exact", "same"):
        r = out[v]
        assert r["rate_status"] == "ok" and r["rate_gain"] == pytest.approx(0.2)
        assert [r["rate_25"], r["rate_50"], r["rate_75"], r["rate"]] == pytest.approx([1.0] * 4)
        assert r["plateau_gap"] == pytest.approx(0.0, abs=1e-12) and r["plateau_evals"] == 3
        assert r["plateau_from_iteration"] == 56
        assert r["rate_lo"] == pytest.approx(1.0) and r["rate_hi"] == pytest.approx(1.0)   # paired: every resample


def test_a_curve_stretched_2x_in_updates_gives_a_rate_of_one_half_and_no_gap():
    out = compared({"exact": EXACT, "slow": (lambda i: exact_curve(i, 2.0), 1.0, 8)})["slow"]
    assert [out["rate_25"], out["rate_50"], out["rate_75"], out["rate"]] == pytest.approx([0.5] * 4)
    assert out["plateau_gap"] == pytest.approx(0.0, abs=1e-12)
    for key in ("rate", "rate_25", "rate_50", "rate_75", "plateau_gap"):
        assert out[f"{key}_lo"] <= out[key] + 1e-12 and out[key] <= out[f"{key}_hi"] + 1e-12


def test_a_curve_that_levels_off_lower_gives_a_rate_of_1_and_the_gap():
    out = compared({"exact": EXACT, "low": (lambda i: exact_curve(i, top=0.68), 1.0, 8)})
    low = out["low"]
    assert low["rate_gain"] == pytest.approx(0.18)                   # the smaller of the two gains
    assert [low["rate_25"], low["rate_50"], low["rate_75"], low["rate"]] == pytest.approx([1.0] * 4)
    assert low["plateau_gap"] == pytest.approx(-0.02)
    # the old figure reads exact at the variant's own end level: it mixes the plateau in (18 / 18 here, but the
    # variant's level is crossed at its plateau's start, not where it rises)
    assert "efficiency_to_lower_final" in low and "measured_efficiency" not in low


def test_intervals_cover_the_value_when_seeds_differ():
    """Seeds with their own speeds (paired: a seed's variants share its speed): every figure has an interval around
    it, wider than a point."""
    speeds = {0: 0.8, 1: 1.0, 2: 1.3, 3: 0.9, 4: 1.1}
    runs = []
    for s, k in speeds.items():
        runs.append(constructed_run("exact", s, lambda i, k=k: exact_curve(i * k)))
        runs.append(constructed_run("slow", s, lambda i, k=k: exact_curve(i * k * (0.5 if s % 2 else 0.7), top=0.69), 0.5, 4))
    out = {r["variant"]: r for r in compare(runs, ["exact", "slow"], list(speeds), "cpu", "test",
                                                              bootstrap=300)}["slow"]
    for key in ("rate", "rate_50", "plateau_gap", "budget_diff"):
        assert out[f"{key}_lo"] <= out[key] <= out[f"{key}_hi"], key
    assert out["rate_lo"] < out["rate_hi"] and out["rate_hi"] < 1.0
    assert out["plateau_gap_lo"] < 0


def test_the_reward_at_an_equal_budget():
    """Curves alike per update; the variant's iteration costs half: when its 20 iterations' 10 CPU seconds run out,
    exact is at iteration 10 (0.60), the variant at its end (0.70). Projected: the variant's iteration costs 1 / r of
    exact's, so the budget is 20 / r of exact's iterations."""
    line = lambda i: 0.5 + 0.01 * i
    runs = [constructed_run("exact", s, line, 1.0, 8, iterations=20) for s in (0, 1)] + \
        [constructed_run("cheap", s, line, 0.5, 4, iterations=20) for s in (0, 1)]
    cost = PRESETS["flow_grpo_sd35_full"]
    out = {r["variant"]: r for r in compare(runs, ["exact", "cheap"], [0, 1], "cpu", "test", cost,
                                                             bootstrap=300)}
    cheap = out["cheap"]
    assert cheap["budget"] == pytest.approx(10.0)
    assert (cheap["budget_exact"], cheap["budget_reward"]) == pytest.approx((0.6, 0.7))
    assert cheap["budget_diff"] == pytest.approx(0.1) and cheap["budget_diff_lo"] <= cheap["budget_diff"] <= cheap["budget_diff_hi"]
    r = cost.iteration_ratio(0.5)
    assert cheap["projected_budget"] == pytest.approx(20 / r)
    assert cheap["projected_budget_diff"] == pytest.approx(0.2 - 0.2 / r)
    assert out["exact"]["budget_diff"] == 0 and out["exact"]["projected_budget_diff"] == 0
    assert cheap["projected_rate"] == pytest.approx(r)                  # rate 1 per update x the iteration ratio


def test_a_variant_that_never_rises_and_a_gain_of_0_read_unreached():
    flat = (lambda i: 0.5, 1.0, 8)
    out = compared({"exact": EXACT, "flat": flat})["flat"]
    assert out["rate_status"] == st.NO_GAIN and math.isnan(out["rate"]) and math.isnan(out["rate_50"])
    assert math.isnan(out["rate_lo"]) and out["rate_undefined_share"] == 1.0
    assert out["plateau_gap"] == pytest.approx(-0.2)                    # the plateau is still read
    both = compared({"exact": flat, "flat": flat})                      # no gain at all: no crash, every rate NaN
    assert all(math.isnan(r["rate"]) and r["rate_status"] == st.NO_GAIN for r in both.values())
    cells = rate_rows([out])[0]
    assert cells["rate_ci"] == cells["rate_50_ci"] == "unreached (no gain)"
    assert "unreached (no gain)" in table(rate_rows([out]), RATE_COLUMNS)
    assert st.rate(np.zeros((2, 3)), np.ones((2, 3)), np.zeros((2, 3)), np.ones((2, 3))).status == st.NO_GAIN


def test_one_evaluation_gives_no_rate():
    runs = [constructed_run(v, s, exact_curve) for s in (0, 1) for v in ("exact", "b")]
    for r in runs:
        r["test_curve"] = r["test_curve"][:1]
    out = {r["variant"]: r for r in compare(runs, ["exact", "b"], [0, 1], "cpu", "train", bootstrap=300)}["b"]
    assert out["rate_status"] == "no evaluations" and math.isnan(out["rate"]) and math.isnan(out["plateau_gap"])
    assert "unreached (no evaluations)" in table(rate_rows([out]), RATE_COLUMNS)


def test_the_statistics_functions():
    assert st.plateau_count(10, 3) == 3 and st.plateau_count(2, 3) == 1 and st.plateau_count(1, 3) == 0
    assert st.resamples(1).tolist() == [[0]]
    boots = st.resamples(4, 50, seed=0)
    assert boots.shape == (50, 4) and boots.min() >= 0 and boots.max() <= 3
    assert (boots == st.resamples(4, 50, seed=0)).all()                 # one seeded bootstrap
    curve, t = np.array([0.5, 0.6, 0.7]), np.array([0.0, 10.0, 20.0])
    assert st.crossing(curve, t, 0.65) == (pytest.approx(15.0), True) and st.crossing(curve, t, 0.9) == (20.0, False)
    assert st.at_budget(curve[None], t[None], 5.0) == pytest.approx(0.55)
    assert math.isnan(st.at_budget(curve[None], t[None], 25.0))
    with pytest.raises(ValueError, match="at least one"):
        st.resamples(0)


def test_a_runs_summary_keeps_its_evaluations_their_cost_and_the_meter_along_the_run():
    from lab.quality_runs import summarize
    from jagg.trainers.shapes_config import ShapesTrainConfig

    cfg = ShapesTrainConfig()
    train = [{"kind": "train", "iteration": i, "wall_s": i, "cpu_s": i, "reward_mean": 0.5, "sample_s": 0.5,
              "reward_s": 0.1, "train_s": 0.4, "iter_s": 1.0, "iter_cpu_s": 1.0, "backward_items": 8} for i in (1, 2)]
    evals = [{"kind": "eval", "iteration": i, "wall_s": i, "reward_mean": 0.5, "eval_s": 2.5} for i in (0, 2)]
    audits = [{"kind": "audit", "iteration": i, "error_to_noise": 0.5 * i, "bias_to_noise": 0.1, "bias_z": 0.2 * i}
              for i in (1, 2)]
    r = summarize(train + evals + audits, cfg, "v", 0)
    assert r["evaluations"] == 2 and r["eval_s"] == 5.0
    assert r["meter_curve"] == [[1, 0.5, 0.1, 0.2], [2, 1.0, 0.1, 0.4]] and r["meter"]["bias_z"] == 0.4


def test_late_rise_tells_a_levelled_curve_from_one_still_rising():
    """A plateau read where the curve still rises is no plateau; the late rise (the last 3 evaluations - the 3
    before them) is 0 on a levelled curve and the curve's rise over 6 iterations on one still rising."""
    out = compared({"exact": EXACT, "rising": (lambda i: exact_curve(i, stretch=10.0), 1.0, 8)})
    assert out["exact"]["late_rise"] == pytest.approx(0.0, abs=1e-12)
    assert out["exact"]["plateau_status"] == "levelled"
    assert out["rising"]["late_rise"] == pytest.approx(0.006)           # 0.001 per iteration, 6 iterations apart
    assert out["rising"]["late_rise_lo"] > 0 and out["rising"]["plateau_status"] == "rising"
    rows = rate_rows(list(out.values()))
    assert "rising" in table(rows, RATE_COLUMNS) and "late rise" in table(rows, RATE_COLUMNS)
    assert math.isnan(st.late_rise(np.array([[0.5, 0.6, 0.7]]), 3))       # too few evaluations to tell


def test_the_gap_splits_into_the_lag_a_rate_explains_and_a_plateau_of_its_own():
    """A curve that is exact's stretched 2x while exact still rises ends lower by exactly what the rate explains
    (lag = gap, own plateau 0); a curve that rises as fast and levels off 0.02 lower has no lag and its own plateau
    -0.02."""
    rising = lambda i, stretch=1.0: exact_curve(i, stretch=10.0 * stretch)      # 0.001 per iteration, never level
    out = compared({"exact": (rising, 1.0, 8), "slow": (lambda i: rising(i, 2.0), 1.0, 8)})["slow"]
    assert out["rate"] == pytest.approx(0.5)
    assert out["plateau_gap"] == pytest.approx(-0.029) and out["lag_gap"] == pytest.approx(-0.029)
    assert out["plateau_excess"] == pytest.approx(0.0, abs=1e-12)
    low = compared({"exact": EXACT, "low": (lambda i: exact_curve(i, top=0.68), 1.0, 8)})["low"]
    assert low["lag_gap"] == pytest.approx(0.0, abs=1e-12) and low["plateau_excess"] == pytest.approx(-0.02)
    curve, clock = np.array([[0.5, 0.6]]), np.array([[0.0, 10.0]])
    assert math.isnan(st.lag_gap(curve, clock, math.nan))                      # an undefined rate explains nothing
    assert st.lag_gap(curve, clock, 0.5) == pytest.approx(-0.05) and st.lag_gap(curve, clock, 1.5) == 0.0


def test_one_seed_reports_no_intervals_and_the_legend_is_formatted(capsys):
    """Intervals are over seeds: with one seed there are none (None, printed as the value alone), never a "95%
    interval" of zero width; the report's legend has its numbers filled in (an unformatted "{k}" was printed)."""
    from lab.quality_report import print_report

    one = compared({"exact": EXACT, "slow": (lambda i: exact_curve(i, stretch=2.0), 1.0, 4)}, seeds=(0,))
    for r in one.values():
        assert all(v is None for k, v in r.items() if k.endswith(("_lo", "_hi"))) and r["within_exact_interval"] is None
    assert one["slow"]["rate"] == pytest.approx(0.5, abs=0.05)                   # the figures themselves stay
    print_report([], list(one.values()), [0], "a cost line")
    text = capsys.readouterr().out
    assert "one seed: no intervals" in text and "95% bootstrap" not in text and "{k}" not in text
    two = compared({"exact": EXACT, "slow": (lambda i: exact_curve(i, stretch=2.0), 1.0, 4)}, seeds=(0, 1))
    assert two["slow"]["rate_lo"] is not None
    print_report([], list(two.values()), [0, 1], "a cost line")
    text = capsys.readouterr().out
    assert "95% bootstrap intervals" in text and "{k}" not in text and "last 3 evaluations - the 3 before" in text
