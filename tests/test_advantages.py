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
