"""Golden gradients of every knot layout, routing, the correction and subsampling as they were before interval
subsampling and the new corrections existed (run at commit f4a6ced from the repository root:
`PYTHONPATH=<checkout at f4a6ced>/src python tests/data/make_layouts_golden.py`).

Float64 toys; tests/test_interval_subsampling.py checks that `interval_frac=1` (and the new keys at their defaults)
reproduces them (bit for bit on the machine that wrote them, within rtol=1e-12 on any CPU)."""
import copy
import sys

import torch

sys.path.insert(0, "tests")
import jagg
from toy import Nonlinear, perturb, run, sampled_traj

CASES = {
    "shared_w4_interp": dict(mode="jagg", window=4, knots="shared", correction_p=0.0, micro_batch=8, clip_range=0.05),
    "shared_w3_fresh_route": dict(mode="jagg", window=3, knots="shared", intermediate="fresh", jagg_frac=0.5,
                                  score="chord", correction_p=0.0, micro_batch=5, clip_range=0.05),
    "adaptive_w4_interp": dict(mode="jagg", window=4, knots="adaptive", correction_p=0.0, micro_batch=6,
                               clip_range=0.05),
    "groups_w4_corrected": dict(mode="jagg", window=4, correction_p=0.5, micro_batch=4, clip_range=0.05),
    "shared_w4_corrected_mb2": dict(mode="jagg", window=4, knots="shared", correction_p=0.5, micro_batch=2,
                                    clip_range=0.05),
    "shared_w4_route_corrected": dict(mode="jagg", window=4, knots="shared", jagg_frac=0.5, correction_p=0.25,
                                      correction_intervals=2, micro_batch=8, clip_range=0.05),
    "groups_w5_fresh_kl_corrected": dict(mode="jagg", window=5, intermediate="fresh", correction_p=0.25,
                                         exact_last_intervals=1, micro_batch=5, clip_range=0.05, kl_beta=0.2),
    "subsample_0.4": dict(mode="subsample", subsample_frac=0.4, micro_batch=7, clip_range=0.05),
}

if __name__ == "__main__":
    out = {}
    for name, kw in CASES.items():
        torch.manual_seed(0)
        model = Nonlinear(batch=6)
        ref = copy.deepcopy(model)
        traj = sampled_traj(model, B=6, T=11)
        perturb(model, 0.05)
        adv = torch.linspace(-1.5, 1.5, 6, dtype=torch.float64)
        ref_v = jagg.reference_velocities(ref, traj) if kw.get("kl_beta") else None
        g, st = run(model, traj, adv, jagg.EstimatorConfig(**kw), ref_velocities=ref_v,
                    prompt_groups=[0, 0, 1, 1, 2, 2], generator=torch.Generator().manual_seed(3))
        out[name] = {"config": kw, "grad": g.clone(), "backward_items": st.backward_items,
                     "forward_nograd_items": st.forward_nograd_items, "loss": st.loss,
                     "intervals_corrected": st.intervals_corrected}
        print(name, g.norm().item(), st.backward_items, st.forward_nograd_items, st.intervals_corrected)
    torch.save(out, "tests/data/layouts_golden.pt")
