"""Run outputs: metrics as JSONL (+ TensorBoard), the reward-curve plot and image grids."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np


class MetricsLogger:
    """Appends one JSON record per line to ``metrics.jsonl``; mirrors numeric values to TensorBoard.

    On resume, records after the resumed iteration are dropped so the file reads as one uninterrupted run.
    """

    def __init__(self, out_dir: Path, tensorboard: bool = True, resume_iteration: int | None = None):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_iteration is None:
            self.path.write_text("")
        elif self.path.exists():
            keep = [l for l in self.path.read_text().splitlines() if l and json.loads(l)["iteration"] <= resume_iteration]
            self.path.write_text("".join(l + "\n" for l in keep))
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(out_dir) / "tensorboard"), purge_step=resume_iteration)
            except ImportError:
                warnings.warn("tensorboard is not installed: pip install tensorboard (or set log.tensorboard=false)")

    def log(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            kind = record.get("kind", "train")
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration" and math.isfinite(v):
                    self.tb.add_scalar(f"{kind}/{k}", v, record["iteration"])
            self.tb.flush()

    def records(self, kind: str | None = None) -> list[dict]:
        rows = [json.loads(l) for l in self.path.read_text().splitlines() if l]
        return [r for r in rows if kind is None or r.get("kind") == kind]

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def plot_reward_curve(records: list[dict], path: Path, title: str = "reward") -> None:
    """Train reward per iteration and held-out eval reward, against iterations, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("kind") == "train"]
    ev = [r for r in records if r.get("kind") == "eval"]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    if train:
        ax.plot([r["iteration"] for r in train], [r["reward_mean"] for r in train], alpha=0.5, label="train reward")
    if ev:
        ax.plot([r["iteration"] for r in ev], [r["reward_mean"] for r in ev], "o-", label="test reward (ODE)")
        if "held_out_reward" in ev[0]:
            ax.plot([r["iteration"] for r in ev], [r["held_out_reward"] for r in ev], "s--",
                    label="test reward, held-out combos")
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def save_grid(images: np.ndarray, path: Path, ncol: int = 8, scale: int = 4, prompts: list[str] | None = None) -> None:
    """uint8 ``[N, H, W, 3]`` -> one PNG grid (nearest-upscaled ``scale`` times); prompts to a sidecar .txt."""
    from PIL import Image

    n, h, w, _ = images.shape
    ncol = min(ncol, n)
    nrow = math.ceil(n / ncol)
    grid = np.full((nrow * (h + 1) + 1, ncol * (w + 1) + 1, 3), 255, dtype=np.uint8)
    for i in range(n):
        r, c = divmod(i, ncol)
        grid[1 + r * (h + 1) : 1 + r * (h + 1) + h, 1 + c * (w + 1) : 1 + c * (w + 1) + w] = images[i]
    img = Image.fromarray(grid).resize((grid.shape[1] * scale, grid.shape[0] * scale), Image.NEAREST)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    if prompts is not None:
        path.with_suffix(".txt").write_text("".join(f"{i}: {p}\n" for i, p in enumerate(prompts)))
