"""Bench-quality runs constructed without training, for the lab's statistics and the tools that read stored runs: a
held-out reward that follows a given curve of the iteration, at a given cost per iteration."""

EVALS = list(range(0, 61, 2))                  # evaluations every 2 iterations, 60 iterations


def exact_curve(i, stretch=1.0, top=0.7):
    """0.5 at the start, rising 0.01 per iteration (``stretch`` x slower), level from ``top`` on."""
    return min(0.5 + 0.01 * i / stretch, top)


def constructed_run(variant, seed, curve, per_iter=1.0, rows=8, offset=0.0, iterations=60):
    """A bench-quality run whose held-out reward follows ``curve(iteration)`` (+ ``offset``, the seed's), each
    iteration ``per_iter`` seconds (wall and CPU)."""
    its = range(1, iterations + 1)
    test = [[i, i * per_iter, curve(i) + offset] for i in EVALS if i <= iterations]
    config = {"seed": seed, "estimator": {"mode": variant}, "eval": {"every": 10}, "log": {"output_dir": f"{seed}"}}
    return {"kind": "run", "variant": variant, "seed": seed, "updates": iterations, "iterations": iterations,
            "config": config,
            "train_curve": [[i, i * per_iter, curve(i) + offset, i * per_iter] for i in its],
            "test_curve": test, "final_test_reward": test[-1][2], "final_test_reward_std": 0.1, "eval_images": 100,
            "sample_s": 0.5, "reward_s": 0.0, "train_s": per_iter - 0.5, "iter_s": per_iter, "iter_cpu_s": per_iter,
            "rows_per_update": rows, "nograd_per_update": 0, "wall_s": iterations * per_iter}
