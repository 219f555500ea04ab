import pytest
import torch

import jagg


def test_group_advantages_per_prompt():
    r = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 13.0])
    ids = ["a", "a", "a", "b", "b", "b"]
    adv = jagg.group_advantages(r, ids, adv_clip_max=100)
    sa = torch.tensor([1.0, 2.0, 3.0]).std(unbiased=False)
    assert torch.allclose(adv[:3], (torch.tensor([1.0, 2.0, 3.0]) - 2) / (sa + 1e-4))
    sb = torch.tensor([10.0, 10.0, 13.0]).std(unbiased=False)
    assert torch.allclose(adv[3:], (torch.tensor([10.0, 10.0, 13.0]) - 11) / (sb + 1e-4))


def test_group_advantages_global_std_and_clip():
    r = torch.tensor([0.0, 1.0, 0.0, 100.0])
    ids = [0, 0, 1, 1]
    adv = jagg.group_advantages(r, ids, global_std=True, adv_clip_max=100)
    assert torch.allclose(adv, (r - torch.tensor([0.5, 0.5, 50, 50])) / (r.std(unbiased=False) + 1e-4))
    clipped = jagg.group_advantages(torch.tensor([0.0, 0.0, 0.0, 1.0]), [0] * 4, adv_clip_max=1.0)
    assert clipped.max() == 1.0 and clipped.min() >= -1.0


def test_zero_spread_groups_detected_and_get_zero_advantage():
    r = torch.tensor([0.5, 0.5, 0.1, 0.9])
    ids = ["x", "x", "y", "y"]
    assert jagg.nonzero_spread_mask(r, ids).tolist() == [False, False, True, True]
    assert (jagg.group_advantages(r, ids)[:2] == 0).all()


def test_bad_rewards_raise():
    with pytest.raises(ValueError, match="NaN"):
        jagg.group_advantages(torch.tensor([1.0, float("nan")]), [0, 0])
    with pytest.raises(ValueError, match="prompt ids"):
        jagg.group_advantages(torch.tensor([1.0, 2.0]), [0])


def test_advantages_under_float64_default_dtype_and_array_likes():
    """Whatever the default dtype and the rewards' container (tensor of any dtype, list, numpy array)."""
    import numpy as np

    from jagg import group_advantages, nonzero_spread_mask

    want = group_advantages(torch.tensor([1.0, 2.0, 3.0, 3.0]), ["a", "a", "b", "b"])
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for r in (torch.tensor([1.0, 2.0, 3.0, 3.0]), torch.tensor([1, 2, 3, 3]), [1.0, 2.0, 3.0, 3.0],
                  np.array([1.0, 2.0, 3.0, 3.0])):
            assert torch.allclose(group_advantages(r, ["a", "a", "b", "b"]), want)
            assert nonzero_spread_mask(r, ["a", "a", "b", "b"]).tolist() == [True, True, False, False]
    finally:
        torch.set_default_dtype(old)
    with pytest.raises(TypeError, match="rewards must be"):
        group_advantages(["x", "y"], [0, 0])
    with pytest.raises(ValueError, match="prompt ids"):
        nonzero_spread_mask([1.0, 2.0], [0])
