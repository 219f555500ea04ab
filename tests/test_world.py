"""The shapes world: grammar, scenes, rendering, tokenizer and prompt splits."""

import itertools

import numpy as np
import pytest
import torch

from jagg.shapes import (BACKGROUND, CATEGORIES, COLORS, HELD_OUT_PAIRS, ObjectSpec, PromptSpec, all_prompts,
                        from_tensor, parse_prompt, render, render_batch, sample_scene, test_prompts, to_tensor,
                        tokenizer, train_prompts, uses_held_out)
from jagg.shapes.scene import GAP


def test_parse_round_trip_over_the_whole_grammar():
    for cat, specs in all_prompts().items():
        for spec in specs:
            assert spec.category == cat
            assert parse_prompt(spec.to_text()) == spec
            assert parse_prompt(spec.to_text()).to_text() == spec.to_text()


@pytest.mark.parametrize("text, category", [
    ("a circle", "single_object"), ("a red circle", "colors"), ("three blue squares", "counting"),
    ("two triangles", "counting"), ("a circle and a square", "two_object"),
    ("a red square and a blue circle", "color_attr"), ("a green triangle to the left of a yellow circle", "position"),
    ("a circle below a square", "position"),
])
def test_categories(text, category):
    assert parse_prompt(text).category == category


def test_parse_normalises_case_spaces_and_one():
    assert parse_prompt("  One RED   circle ") == PromptSpec((ObjectSpec("circle", "red"),))
    assert parse_prompt("a white square above a blue square").relation == "above"


@pytest.mark.parametrize("text, match", [
    ("a purple circle", "'purple'"), ("a red circle near a square", "'near'"), ("", "empty"),
    ("a red", "ends before the shape"), ("two circle", "circles"), ("a circles", "circle"),
    ("a circle and a circle", "two"), ("a circle to the left of a red circle", "told apart"),
    ("two circles and a square", "single-object"), ("a circle square", "'square'"),
])
def test_parse_errors_say_what_is_wrong(text, match):
    with pytest.raises(ValueError, match=match):
        parse_prompt(text)


def _overlaps(a, b):
    d = (a.size + b.size) / 2 + GAP - 1e-9
    return abs(a.center[0] - b.center[0]) < d and abs(a.center[1] - b.center[1]) < d


def test_sampled_scenes_match_their_prompt():
    rng = np.random.default_rng(0)
    for text in test_prompts() + train_prompts()[::5]:
        spec = parse_prompt(text)
        for _ in range(3):
            scene = sample_scene(spec, rng)
            assert len(scene.objects) == sum(o.count for o in spec.objects)
            for o in spec.objects:
                assert sum(o.matches(x.color, x.shape) for x in scene.objects) >= o.count
            for a, b in itertools.combinations(scene.objects, 2):
                assert not _overlaps(a, b)
            for x in scene.objects:
                assert x.size / 2 <= min(*x.center, 1 - x.center[0], 1 - x.center[1])
            if not uses_held_out(spec):  # free colours avoid held-out pairs by default
                assert not any((x.color, x.shape) in HELD_OUT_PAIRS for x in scene.objects)
            if spec.relation == "left_of":
                assert scene.objects[0].center[0] < scene.objects[1].center[0]
            if spec.relation == "below":
                assert scene.objects[0].center[1] > scene.objects[1].center[1]


def test_sample_scene_is_deterministic_given_a_seed():
    assert sample_scene("three red circles", 7) == sample_scene("three red circles", 7)
    assert sample_scene("three red circles", 7) != sample_scene("three red circles", 8)


def test_render_paints_palette_colours_on_background():
    scene = sample_scene("a red circle to the left of a blue square", 0)
    img = render(scene)
    assert img.shape == (32, 32, 3) and img.dtype == np.uint8
    colours = {tuple(c) for c in img.reshape(-1, 3)}
    assert colours == {BACKGROUND, COLORS["red"], COLORS["blue"]}
    for obj in scene.objects:  # the centre pixel has the object's colour
        x, y = (int(v * 32) for v in obj.center)
        assert tuple(img[y, x]) == COLORS[obj.color]
    assert tuple(img[0, 0]) == BACKGROUND
    assert render_batch([scene, scene], size=48).shape == (2, 48, 48, 3)


def test_tensor_round_trip():
    imgs = render_batch([sample_scene(p, i) for i, p in enumerate(test_prompts()[:4])])
    x = to_tensor(imgs)
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32
    assert x.min() >= -1 and x.max() <= 1
    np.testing.assert_array_equal(from_tensor(x), imgs)
    assert from_tensor(torch.full((1, 3, 2, 2), 5.0)).min() == 255  # clamped
    with pytest.raises(ValueError, match="uint8"):
        to_tensor(imgs.astype(np.float32))


def test_tokenizer_round_trip_and_padding():
    prompts = train_prompts() + test_prompts()
    ids = tokenizer.encode(prompts)
    assert ids.shape == (len(prompts), 16) and ids.dtype == torch.long
    assert 0 <= ids.min() and ids.max() < tokenizer.vocab_size
    assert tokenizer.decode(ids) == prompts
    empty = tokenizer.encode(["", "a red circle"], max_len=8)
    assert (empty[0] == tokenizer.PAD_ID).all() and (empty[1, :3] != 0).all() and (empty[1, 3:] == 0).all()


def test_tokenizer_errors():
    with pytest.raises(ValueError, match="'purple'.*'a purple circle'|'a purple circle'.*'purple'"):
        tokenizer.encode(["a red circle", "a purple circle"])
    with pytest.raises(ValueError, match="has 10 words, more than the 4 the model reads"):
        tokenizer.encode(["a red circle to the left of a blue square"], max_len=4)


def test_splits_are_fixed_disjoint_and_hold_out_combinations():
    train, test = train_prompts(), test_prompts()
    assert train == train_prompts() and test == test_prompts()
    train.append("mutated")
    assert "mutated" not in train_prompts()
    train.pop()
    assert 200 <= len(train) <= 500 and 50 <= len(test) <= 100
    assert len(set(train)) == len(train) and len(set(test)) == len(test) and not set(train) & set(test)
    assert {parse_prompt(p).category for p in test} == set(CATEGORIES)
    assert {parse_prompt(p).category for p in train} == set(CATEGORIES)
    assert not any(uses_held_out(p) for p in train)
    held = [p for p in test if uses_held_out(p)]
    assert 20 <= len(held) < len(test)
    seen_pairs = {(o.color, o.shape) for p in train for o in parse_prompt(p).objects}
    assert not seen_pairs & HELD_OUT_PAIRS
    assert {(o.color, o.shape) for p in held for o in parse_prompt(p).objects} >= HELD_OUT_PAIRS
