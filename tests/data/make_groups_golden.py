"""Golden gradients of the estimator before knots existed (run at commit 3fb7ec0: `python tests/data/make_groups_golden.py`;
the names are today's, the file holds them as they were then: `exact_first_groups`, see tests/test_knots.py).

Float64 toys, several settings; tests/test_knots.py checks that `knots="groups"` reproduces them bit for bit."""
import sys, torch
sys.path.insert(0, "tests")
import jagg
from toy import Nonlinear, sampled_traj, perturb, run
CASES = {
 "w4_interp": dict(mode="jagg", window=4, intermediate="interp", micro_batch=4, clip_range=0.05),
 "w3_fresh": dict(mode="jagg", window=3, intermediate="fresh", micro_batch=5, clip_range=0.05),
 "w4_route_half": dict(mode="jagg", window=4, jagg_frac=0.5, score="chord", micro_batch=6, clip_range=0.05),
 "w5_first_exact": dict(mode="jagg", window=5, exact_first_intervals=1, micro_batch=3, clip_range=0.05, kl_beta=0.2),
 "exact": dict(mode="exact", micro_batch=7, clip_range=0.05),
}
out = {}
for name, kw in CASES.items():
    torch.manual_seed(0)
    model = Nonlinear(batch=6)
    ref = __import__("copy").deepcopy(model)
    traj = sampled_traj(model, B=6, T=11)
    perturb(model, 0.05)
    adv = torch.linspace(-1.5, 1.5, 6, dtype=torch.float64)
    ref_v = jagg.reference_velocities(ref, traj) if kw.get("kl_beta") else None
    g, st = run(model, traj, adv, jagg.EstimatorConfig(**kw), ref_velocities=ref_v, prompt_groups=[0, 0, 1, 1, 2, 2])
    out[name] = {"config": kw, "grad": g.clone(), "backward_items": st.backward_items, "forward_nograd_items": st.forward_nograd_items, "loss": st.loss}
    print(name, g.norm().item(), st.backward_items, st.forward_nograd_items)
torch.save(out, "tests/data/groups_golden.pt")
