"""The shapes-world GenEval reward, the JPEG rewards and the reward registry."""

import re

import numpy as np
import pytest

from jagg.rewards import get_reward
from jagg.shapes.geneval import GenevalReward
from jagg.shapes import Scene, SceneObject, parse_prompt, render, render_prompts, test_prompts, to_tensor


@pytest.fixture(scope="module")
def ground_truth():
    prompts = test_prompts() * 4
    images, _ = render_prompts(prompts, 0)
    return images, prompts


def test_ground_truth_scores_one_for_every_test_prompt(ground_truth):
    images, prompts = ground_truth
    scores, info = GenevalReward()(images, prompts)
    assert scores.dtype == np.float32 and scores.shape == (len(prompts),)
    assert scores.mean() >= 0.98 and info["correct"].mean() >= 0.98
    assert scores.min() == 1.0, [p for p, s in zip(prompts, scores) if s < 1]
    assert info["category"] == [parse_prompt(p).category for p in prompts]
    for cat in ("single_object", "two_object", "counting", "colors", "position", "color_attr"):
        assert info[f"accuracy/{cat}"] == 1.0


def test_model_space_input_gives_the_same_scores(ground_truth):
    images, prompts = ground_truth
    a, _ = GenevalReward()(images[:16], prompts[:16])
    b, _ = GenevalReward()(to_tensor(images[:16]), prompts[:16])
    np.testing.assert_array_equal(a, b)


def test_robust_to_mild_pixel_noise(ground_truth):
    images, prompts = ground_truth
    noisy = np.clip(images + np.random.default_rng(0).normal(0, 10, images.shape), 0, 255).astype(np.uint8)
    scores, info = GenevalReward()(noisy, prompts)
    assert scores.mean() >= 0.98 and info["correct"].mean() >= 0.98


def test_mismatched_prompts_score_low(ground_truth):
    images, prompts = ground_truth
    shuffled = [prompts[i] for i in np.random.default_rng(0).permutation(len(prompts))]
    scores, info = GenevalReward()(images, shuffled)
    assert scores.mean() < 0.5 and info["correct"].mean() < 0.3


def _scene(*objs):
    return render(Scene(tuple(SceneObject(c, s, xy, 0.3) for c, s, xy in objs)))


def test_partial_credit_is_the_fraction_of_constraints():
    r = GenevalReward()
    swapped = _scene(("blue", "square", (0.25, 0.5)), ("red", "circle", (0.75, 0.5)))
    scores, info = r(swapped[None], ["a red square and a blue circle"])
    assert scores[0] == pytest.approx(3 / 5) and not info["correct"][0]  # shapes and count right, colours wrong
    left = _scene(("red", "circle", (0.25, 0.5)), ("blue", "square", (0.75, 0.5)))
    scores, info = r(np.stack([left, left]), ["a red circle to the left of a blue square",
                                             "a red circle to the right of a blue square"])
    assert scores[0] == 1.0 and scores[1] == pytest.approx(5 / 6)
    assert info["constraints"][1]["relation"] is False
    two = _scene(("red", "circle", (0.25, 0.5)), ("red", "circle", (0.75, 0.5)))
    empty = _scene()
    scores, _ = r(np.stack([two, two, empty]), ["two red circles", "a red circle", "a circle"])
    assert scores.tolist() == [1.0, 0.0, 0.0]


def test_jpeg_rewards_prefer_flat_or_busy_images():
    flat = np.full((1, 32, 32, 3), 128, np.uint8)
    noise = np.random.default_rng(0).integers(0, 256, (1, 32, 32, 3), dtype=np.uint8)
    images, prompts = np.concatenate([flat, noise]), ["a circle", "a circle"]
    comp, info = get_reward("jpeg_compressibility")(images, prompts, None)
    incomp, _ = get_reward("jpeg_incompressibility")(images, prompts, None)
    assert comp[0] > comp[1] and incomp[0] < incomp[1]
    np.testing.assert_allclose(comp, -incomp)
    assert (info["jpeg_kb"] > 0).all()


def test_weighted_sum(ground_truth):
    images, prompts = ground_truth[0][:6], ground_truth[1][:6]
    g, _ = get_reward("geneval")(images, prompts, None)
    j, _ = get_reward("jpeg_compressibility")(images, prompts, None)
    total, info = get_reward({"geneval": 1.0, "jpeg_compressibility": 0.1})(images, prompts, None)
    np.testing.assert_allclose(total, g + 0.1 * j, rtol=1e-6)
    np.testing.assert_array_equal(info["scores/geneval"], g)
    assert "geneval/correct" in info and "jpeg_compressibility/jpeg_kb" in info


USER_MODULE = '''
import numpy as np
def brightness(images, prompts, metadata):
    return [float(im.mean()) / 255 for im in images]
def with_info(images, prompts, metadata):
    return np.ones(len(images)), {"n": len(images)}
def nan_at_2(images, prompts, metadata):
    s = np.zeros(len(images)); s[2] = np.nan
    return s
def too_short(images, prompts, metadata):
    return np.zeros(len(images) - 1)
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_jagg_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_jagg_rewards"


def test_user_reward_from_module_path(user_module):
    images = np.stack([np.zeros((32, 32, 3), np.uint8), np.full((32, 32, 3), 255, np.uint8)])
    scores, info = get_reward(f"{user_module}:brightness")(images, ["a circle"] * 2, None)
    assert scores.dtype == np.float32 and scores.tolist() == [0.0, 1.0] and info == {}
    scores, info = get_reward(f"{user_module}:with_info")(images, ["a circle"] * 2, None)
    assert scores.tolist() == [1.0, 1.0] and info == {"n": 2}


def test_reward_errors(user_module):
    images = np.zeros((4, 32, 32, 3), np.uint8)
    prompts = ["a circle"] * 4
    with pytest.raises(ValueError, match="nan_at_2.*batch index 2"):
        get_reward(f"{user_module}:nan_at_2")(images, prompts, None)
    with pytest.raises(ValueError, match="too_short.*shape"):
        get_reward(f"{user_module}:too_short")(images, prompts, None)
    with pytest.raises(ValueError, match="nan_at_2.*batch index 2"):  # inside a weighted sum, too
        get_reward({"geneval": 1.0, f"{user_module}:nan_at_2": 1.0})(images, prompts, None)
    with pytest.raises(ValueError, match="available: .*geneval.*jpeg_compressibility.*pickscore"):
        get_reward("imagereward")
    with pytest.raises(ValueError, match="cannot load"):
        get_reward(f"{user_module}:missing")
    with pytest.raises(ValueError, match="4 images but 3 prompts"):
        get_reward("geneval")(images, prompts[:3], None)
    with pytest.raises(ValueError, match="uint8"):
        get_reward("geneval")(images.astype(np.float32), prompts, None)
    with pytest.raises(ValueError, match="'purple'"):
        get_reward("geneval")(images, ["a purple circle"] * 4, None)


def test_evaluate_reports_pass_rate_per_constraint_kind(monkeypatch):
    """`evaluate` (jagg eval, the trainer's evaluation) reports pass/<kind>: 1.0 for every kind on ground truth,
    0.0 for every kind on blank images (every prompt asks for at least one object)."""
    from jagg.shapes import evaluation
    from jagg.shapes.scene import BACKGROUND

    prompts = test_prompts()
    truth = {"images": render_prompts([p for p in prompts for _ in range(2)], 0)[0]}   # evaluate's order
    monkeypatch.setattr(evaluation, "generate", lambda model, batch, *a, **k: truth["images"][:len(batch)])
    m, _, batch = evaluation.evaluate(None, GenevalReward(), images_per_prompt=2)
    kinds = {"pass/shape", "pass/color", "pass/relation", "pass/no_extra"}
    assert kinds <= set(m) and all(m[k] == 1.0 for k in kinds)
    truth["images"] = np.zeros_like(truth["images"]) + np.array(BACKGROUND, np.uint8)
    m, _, _ = evaluation.evaluate(None, GenevalReward(), images_per_prompt=2)
    assert all(m[k] == 0.0 for k in kinds), m


def test_evaluate_reports_each_component_of_a_weighted_reward(monkeypatch):
    """With reward.weights, evaluate reports each component's unweighted mean (reward/<name>) and still the
    GenEval-like accuracies and pass rates of the geneval component; their weighted sum is reward_mean."""
    from jagg.rewards.registry import get_reward
    from jagg.shapes import evaluation

    prompts = test_prompts()[:12]
    images = render_prompts(prompts, 0)[0]
    monkeypatch.setattr(evaluation, "generate", lambda model, batch, *a, **k: images[:len(batch)])
    m, _, _ = evaluation.evaluate(None, get_reward({"geneval": 1.0, "jpeg_compressibility": 0.5}), num_prompts=12,
                                  images_per_prompt=1)
    assert m["reward/geneval"] == 1.0 and m["reward/jpeg_compressibility"] < 0
    assert m["reward_mean"] == pytest.approx(1.0 + 0.5 * m["reward/jpeg_compressibility"], rel=1e-5)
    assert m["accuracy"] == 1.0 and m["pass/shape"] == 1.0 and "accuracy/colors" in m


def test_rewards_do_not_import_the_shapes_world():
    """A real-model user's reward server pulls in no toy task: importing the reward modules loads no jagg.shapes
    module (a fresh interpreter, so that no other test's import counts)."""
    import subprocess
    import sys

    code = ("import sys; import jagg.rewards.server, jagg.rewards.registry, jagg.rewards.client, "
            "jagg.rewards.protocol; print(sorted(m for m in sys.modules if m.startswith('jagg.shapes') "
            "or m == 'transformers'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"                       # nor transformers: a preference model imports it when built


def test_the_shapes_world_registers_geneval_itself():
    import jagg.shapes  # noqa: F401  (registers 'geneval')
    from jagg.rewards import available_rewards

    assert "geneval" in available_rewards()


def test_registered_rewards_take_options_in_their_name(monkeypatch):
    """'name:key=value,...': keyword arguments of the factory, converted to the type of its defaults; the trainer's
    defaults reach only factories that take them and lose to the spec's own options."""
    from jagg.rewards.registry import REWARDS, parse_spec

    made = []

    def toy(scale: float = 1.0, flag: bool = False, n: int = 2, device: str = "auto", label=None):
        made.append(dict(scale=scale, flag=flag, n=n, device=device, label=label))
        return lambda images, prompts, metadata=None: np.full(len(images), scale * n, np.float32)

    monkeypatch.setitem(REWARDS, "toy", toy)
    images = np.zeros((2, 8, 8, 3), np.uint8)
    scores, _ = get_reward("toy:scale=2.5, flag=true,n=3,label=a/b", {"device": "cuda:1", "dtype": "bf16"})(
        images, ["x", "y"], None)
    assert made[-1] == dict(scale=2.5, flag=True, n=3, device="cuda:1", label="a/b") and scores.tolist() == [7.5] * 2
    get_reward("toy:device=cpu", {"device": "cuda:1"})
    assert made[-1]["device"] == "cpu"                      # the spec wins over the trainer's default
    assert parse_spec("toy") == ("toy", {}) and parse_spec("toy:n=1,") == ("toy", {"n": "1"})
    for spec, message in (("toy:flag=yes", "flag must be true or false"), ("toy:n=2.5", "n must be an integer"),
                          ("toy:scale=big", "scale must be a number"), ("toy:n=1,n=2", "'n' is given twice"),
                          ("toy:colour=red", "unknown option(s) ['colour']; its options: scale, flag, n, device")):
        with pytest.raises(ValueError, match=re.escape(message)):
            get_reward(spec)

