"""The drop-in call: one Flow-GRPO update of a toy velocity network, exact vs JAGG.

Run: python examples/quickstart.py
"""

import torch

import jagg

torch.manual_seed(0)
B, S = 8, (3, 8, 8)                                              # batch, latent shape
net = torch.nn.Sequential(torch.nn.Linear(3 * 64 + 1, 256), torch.nn.SiLU(), torch.nn.Linear(256, 3 * 64))
cond = torch.randn(B, 1)                                         # stand-in for per-sample prompt embeddings


def velocity(x, sigma, idx):                                     # (latents [N,*S], sigma [N], idx [N]) -> [N,*S]
    h = torch.cat([x.flatten(1), sigma[:, None] + cond[idx]], 1)
    return net(h).view(-1, *S)


# 1. rollout (no grad): store latents, sigmas, old log-probs, velocities
sigmas = jagg.flow_sigmas(16, shift=3.0)
traj = jagg.sample_trajectories(velocity, torch.randn(B, *S), sigmas, eta=0.7)
# 2. rewards -> group-relative advantages (here: 2 prompts x 4 images)
rewards = -traj.latents[:, -1].pow(2).mean(dim=(1, 2, 3))
prompt_ids = [0] * 4 + [1] * 4
adv = jagg.group_advantages(rewards, prompt_ids=prompt_ids)
# 3. the gradient: replaces the per-step forward/backward loop
opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
grads = {}
for mode in ("exact", "jagg"):
    opt.zero_grad()
    # correction_p=0.0 (the default): the paper's plain JAGG; p > 0 is unbiased JAGG (docs/usage.md: when it pays)
    cfg = jagg.EstimatorConfig(mode=mode, window=4, intermediate="interp", micro_batch=8, correction_p=0.0)
    stats = jagg.policy_gradient(velocity, traj, adv, cfg, prompt_groups=prompt_ids)  # for routing
    grads[mode] = torch.cat([p.grad.flatten() for p in net.parameters()])
    print(f"{mode:5s}: loss={stats.loss:+.4f}  backward items={stats.backward_items:4d}  "
          f"no-grad forwards={stats.forward_nograd_items}  routed to JAGG={stats.jagg_frac_routed:.2f}")
cos = torch.nn.functional.cosine_similarity(grads["exact"], grads["jagg"], dim=0).item()
print(f"cosine(JAGG gradient, exact gradient) = {cos:.4f}")
opt.step()
