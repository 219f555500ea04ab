"""The signs of reward hacking the shapes evaluation reports (`jagg.shapes.evaluation.image_health`), on hand-made
images: empty images, object counts against the asked counts, and a dirty background."""

import numpy as np
import pytest

from jagg.shapes import render_prompts, test_prompts
from jagg.shapes.evaluation import background_rms, image_health
from jagg.shapes.scene import BACKGROUND, COLORS, Scene, SceneObject
from jagg.shapes.render import render_batch


def _blank(n: int) -> np.ndarray:
    return np.zeros((n, 32, 32, 3), np.uint8) + np.array(BACKGROUND, np.uint8)


def test_ground_truth_is_healthy():
    prompts = test_prompts()
    images = render_prompts(prompts, 0)[0]
    h = image_health(images, prompts)
    assert h["empty_frac"] == 0.0 and h["count_error"] == 0.0 and h["background_rms"] == 0.0
    assert h["objects_mean"] == pytest.approx(h["asked_mean"]) and h["asked_mean"] > 1


def test_blank_images_are_empty_and_miss_every_asked_object():
    prompts = ["a circle", "three red squares", "a blue circle to the left of a yellow square"]
    h = image_health(_blank(3), prompts)
    assert h["empty_frac"] == 1.0 and h["objects_mean"] == 0.0
    assert h["asked_mean"] == pytest.approx(2.0) and h["count_error"] == pytest.approx(2.0)
    assert h["background_rms"] == 0.0


def test_an_extra_object_counts_and_one_missing_counts():
    one = Scene((SceneObject("red", "circle", (0.3, 0.5), 0.32),))
    two = Scene((SceneObject("red", "circle", (0.3, 0.5), 0.32), SceneObject("blue", "square", (0.72, 0.5), 0.32)))
    images = render_batch([two, one], 32)
    h = image_health(images, ["a red circle", "a red circle and a blue square"])
    assert h["empty_frac"] == 0.0 and h["objects_mean"] == 1.5 and h["asked_mean"] == 1.5
    assert h["count_error"] == 1.0                                    # one extra in the first, one missing in the second


def test_a_faint_patch_grid_on_the_background_is_measured_and_objects_are_not():
    """A grid of faint lines every 4 pixels (the patch size), far from every palette colour's threshold, leaves the
    detections alone but raises background_rms by about its amplitude x sqrt(its pixel share); objects' own pixels and
    their 1-pixel border never count."""
    prompts = test_prompts()[:16]
    clean = render_prompts(prompts, 1)[0]
    dirty = clean.astype(np.int16)
    line = np.zeros((32, 32), bool)
    line[::4, :] = line[:, ::4] = True
    bg = (np.abs(clean.astype(np.int16) - np.array(BACKGROUND)).sum(-1) == 0)
    dirty[line[None] & bg] += 30                                     # +30 on each channel: 52 in RGB distance
    dirty = dirty.clip(0, 255).astype(np.uint8)
    rms = background_rms(dirty)
    assert (rms > 15).all() and (rms < 52).all()
    assert (background_rms(clean) == 0).all()
    hc, hd = image_health(clean, prompts), image_health(dirty, prompts)
    assert hd["objects_mean"] == hc["objects_mean"] and hd["count_error"] == hc["count_error"]
    # an object colour is not background, whatever it is
    full = np.zeros((1, 32, 32, 3), np.uint8) + np.array(COLORS["white"], np.uint8)
    assert background_rms(full)[0] == 0.0


def test_image_health_checks_its_arguments():
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        image_health(_blank(2), ["a circle"])


def test_the_comparison_grid_shows_the_same_prompts_before_and_after(tmp_path):
    """`save_comparison`: a row of `before` above the same prompts `after`, captioned with score, correctness and
    each constraint's pass (+) or fail (-); returns both sets' means."""
    from PIL import Image

    from jagg.shapes.evaluation import comparison_prompts, save_comparison

    prompts = comparison_prompts(8)
    truth = render_prompts(prompts, 0)[0]
    out = save_comparison(_blank(8), truth, prompts, tmp_path / "cmp.png", ("iteration 0", "iteration 9"), ncol=4)
    assert out == {"before_score": 0.0, "before_accuracy": 0.0, "after_score": 1.0, "after_accuracy": 1.0}
    lines = (tmp_path / "cmp.txt").read_text().splitlines()
    assert len(lines) == 16
    assert lines[0].startswith(f"0: {prompts[0]}; iteration 0: 0.00; -shape:")          # row 1: before, prompts 0-3
    assert lines[4].startswith(f"4: {prompts[0]}; iteration 9: 1.00 correct; +shape:")  # row 2: after, prompts 0-3
    assert lines[8].startswith(f"8: {prompts[4]}; iteration 0")
    assert "-no_extra" in lines[0] and "+no_extra" in lines[4]
    w, h = Image.open(tmp_path / "cmp.png").size
    assert w > 4 * 128 and h > 4 * 128
    with pytest.raises(ValueError, match="do not fill rows"):
        save_comparison(_blank(8), truth, prompts, tmp_path / "x.png", ("a", "b"), ncol=3)
    with pytest.raises(ValueError, match="must match"):
        save_comparison(_blank(7), truth, prompts, tmp_path / "x.png", ("a", "b"))


def test_collapse_warnings_fire_on_each_sign_and_only_then():
    from jagg.shapes.evaluation import collapse_warnings

    def ev(it, r, empty=0.0, bg=1.0):
        return {"iteration": it, "reward_mean": r, "empty_frac": empty, "background_rms": bg}

    rising = [ev(0, 0.47), ev(25, 0.50), ev(50, 0.53)]
    assert collapse_warnings(rising, 0.05, 0.1, 5.0) == []
    assert collapse_warnings(rising[:1], 0.05, 0.1, 5.0) == []
    fell = rising + [ev(75, 0.47)]
    (w,) = collapse_warnings(fell, 0.05, 0.1, 5.0)
    assert "fell to 0.470" in w and "best 0.530 (iteration 50)" in w
    assert collapse_warnings(fell, 0.07, 0.1, 5.0) == []                   # within the margin
    assert collapse_warnings(fell, 0.0, 0.1, 5.0) == []                    # 0 = off
    empty = rising + [ev(75, 0.52, empty=0.15)]
    (w,) = collapse_warnings(empty, 0.05, 0.1, 5.0)
    assert "no object rose from 0.000 to 0.150" in w
    dirty = rising + [ev(75, 0.52, bg=7.0)]
    (w,) = collapse_warnings(dirty, 0.05, 0.1, 5.0)
    assert "background_rms" in w and "1.000 to 7.000" in w
    assert len(collapse_warnings(rising + [ev(75, 0.40, empty=0.5, bg=9.0)], 0.05, 0.1, 5.0)) == 3


