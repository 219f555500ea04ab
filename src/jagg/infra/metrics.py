"""Run outputs: metrics as JSONL (+ TensorBoard), the reward-curve plot and image grids."""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .atomic import atomic_write, atomic_write_text


class MetricsError(ValueError):
    """A ``metrics.jsonl`` whose line before the last is not a record: corrupt, not just torn by an interrupted
    append (the message names the file and the line)."""


@dataclass
class RecordScan:
    """What :func:`scan_records` read in a ``metrics.jsonl``: its records (each with its line number and text) and the
    numbers of the (non-blank) lines that are not a record (not UTF-8, not JSON, not an object with an ``iteration``).
    Only the last line may be such a line: an append cut short by a crash or a full disk (:attr:`torn`)."""

    path: Path
    rows: list[tuple[int, str, dict]] = field(default_factory=list)
    bad: list[tuple[int, bytes]] = field(default_factory=list)
    last: int = 0                                      # the number of the last non-blank line (0: none)

    @property
    def records(self) -> list[dict]:
        return [r for _, _, r in self.rows]

    @property
    def torn(self) -> tuple[int, bytes] | None:
        """The last line ``(number, bytes)`` when it is not a record, else None."""
        return self.bad[-1] if self.bad and self.bad[-1][0] == self.last else None

    def check(self) -> None:
        """Raise :class:`MetricsError` when a line before the last is not a record."""
        early = [n for n, _ in self.bad if n != self.last]
        if early:
            raise MetricsError(f"{self.path} line {early[0]} is not a JSON record (of {self.last} lines"
                               f"{f'; {len(early)} such lines before the last' if len(early) > 1 else ''})")


def scan_records(path: Path) -> RecordScan:
    """Read ``path`` (``metrics.jsonl``) line by line without failing on a bad line (:class:`RecordScan`)."""
    scan = RecordScan(Path(path))
    for n, raw in enumerate(Path(path).read_bytes().split(b"\n"), 1):
        if not raw.strip():
            continue
        scan.last = n
        try:
            text = raw.decode("utf-8")
            record = json.loads(text)
        except (UnicodeDecodeError, ValueError):
            record = None
        if isinstance(record, dict) and isinstance(record.get("iteration"), int):
            scan.rows.append((n, text, record))
        else:
            scan.bad.append((n, raw))
    return scan


def set_aside_torn(scan: RecordScan) -> Path | None:
    """Copy the torn last line of ``scan`` (if any) to ``metrics.jsonl.torn-<YYYYmmdd-HHMMSS>`` next to the file
    (never replacing one), print a warning naming the file and the line, and return the copy's path."""
    if scan.torn is None:
        return None
    n, raw = scan.torn
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, k = scan.path.with_name(f"{scan.path.name}.torn-{stamp}"), 1
    while aside.exists():
        k += 1
        aside = scan.path.with_name(f"{scan.path.name}.torn-{stamp}-{k}")
    atomic_write(aside, lambda f: f.write(raw + b"\n"))
    print(f"warning: {scan.path} line {n} is not a complete record (an append cut short by a crash or a full disk): "
          f"dropped from the run, kept in {aside}", flush=True)
    return aside


def scalars(record: dict) -> dict:
    """The finite numbers of a metrics record (not ``iteration``) under the names TensorBoard and wandb show them,
    ``<kind>/<key>`` (``train/reward_mean``)."""
    kind = record.get("kind", "train")
    return {f"{kind}/{k}": v for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration" and math.isfinite(v)}


class MetricsLogger:
    """Appends one JSON record per line to ``metrics.jsonl``; mirrors its numbers (:func:`scalars`) to TensorBoard
    and, given a :class:`jagg.infra.wandb_run.WandbRun`, to wandb, with the sample grids (:meth:`image`).

    On resume, records after the resumed iteration are dropped so the file reads as one uninterrupted run; a torn
    last line is set aside (:func:`set_aside_torn`), a bad line before it is a :class:`MetricsError`.
    """

    def __init__(self, out_dir: Path, tensorboard: bool = True, resume_iteration: int | None = None, wandb=None):
        self.wandb = wandb
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_iteration is None:
            atomic_write_text(self.path, "")
        elif self.path.exists():
            scan = scan_records(self.path)
            scan.check()
            set_aside_torn(scan)
            atomic_write_text(self.path, "".join(f"{t}\n" for _, t, r in scan.rows if r["iteration"] <= resume_iteration))
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
        numbers = scalars(record)
        if self.tb is not None:
            for name, v in numbers.items():
                self.tb.add_scalar(name, v, record["iteration"])
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(record["iteration"], numbers)

    def image(self, key: str, path: Path, iteration: int) -> None:
        """The sample grid written to ``path`` at ``iteration``, as the image ``key`` to TensorBoard (an animated
        ``.gif``: its first frame) and to wandb (when logging there)."""
        if self.tb is not None:
            from PIL import Image

            with Image.open(path) as picture:
                self.tb.add_image(key, np.asarray(picture.convert("RGB")), iteration, dataformats="HWC")
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.image(key, path, iteration)

    def records(self, kind: str | None = None) -> list[dict]:
        rows = [json.loads(l) for l in self.path.read_text().splitlines() if l]
        return [r for r in rows if kind is None or r.get("kind") == kind]

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


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
    atomic_write(path, lambda f: fig.savefig(f, format="png"))
    plt.close(fig)


CAPTION_MIN_WIDTH = 192  # pixels per captioned cell: about 36 characters per line of PIL's default font


def save_grid(images: np.ndarray, path: Path, ncol: int = 8, scale: int = 4, prompts: list[str] | None = None,
              rewards=None, notes: list[list[str]] | None = None, fps: float = 8.0) -> None:
    """uint8 ``[N, H, W, 3]`` -> one PNG grid, each image nearest-upscaled ``scale`` times; uint8 videos ``[N, F, H,
    W, 3]`` -> an animated GIF grid (``path`` ends in ``.gif``; frame t shows frame t of every video, ``fps`` frames
    per second, looping), written with PIL.

    With ``prompts`` and/or ``rewards`` (one per image), each image is captioned underneath with its prompt
    (wrapped) and a line ``reward 0.812``, the cells upscaled to at least ``CAPTION_MIN_WIDTH`` pixels wide so that
    the text is readable; the captions also go to a sidecar ``.txt``, one line ``<i>: <prompt> (reward <r>)`` each.
    ``notes`` (one list of lines per image) adds lines under those, in the picture and in the sidecar.
    """
    images = np.asarray(images)
    video = images.ndim == 5
    if images.ndim not in (4, 5) or images.shape[-1] != 3 or images.dtype != np.uint8 or not images.size:
        raise ValueError(f"save_grid needs uint8 images [N, H, W, 3] or videos [N, F, H, W, 3] with N >= 1; got "
                         f"{images.dtype} {list(images.shape)}")
    path = Path(path)
    if video != (path.suffix.lower() == ".gif"):
        raise ValueError(f"{path}: videos [N, F, H, W, 3] are written as .gif, images as one of "
                         f"{', '.join(IMAGE_SUFFIXES)}; got {list(images.shape)} for {path.suffix or 'no extension'!r}")
    n, w = images.shape[0], images.shape[-2]
    for name, seq in (("prompts", prompts), ("rewards", rewards), ("notes", notes)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"save_grid: {len(seq)} {name} for {n} images; pass one per image")
    if ncol < 1 or scale < 1:
        raise ValueError(f"save_grid: ncol and scale must be >= 1; got ncol={ncol}, scale={scale}")
    texts = [[p] for p in prompts] if prompts is not None else [[] for _ in range(n)]
    if rewards is not None:
        texts = [t + [f"reward {float(r):.3f}"] for t, r in zip(texts, rewards)]
    captioned = prompts is not None or rewards is not None or notes is not None
    if captioned:
        scale = max(scale, math.ceil(CAPTION_MIN_WIDTH / w))
    extra = [list(map(str, n)) for n in notes] if notes is not None else [[] for _ in range(n)]
    frames = [_grid(f, ncol, scale, texts, extra, captioned) for f in (images.swapaxes(0, 1) if video else [images])]
    if video:
        atomic_write(path, lambda f: frames[0].save(f, format="GIF", save_all=True, append_images=frames[1:],
                                                    duration=round(1000 / fps), loop=0))
    else:
        atomic_write(path, lambda f: frames[0].save(f, format=image_format(path)))
    if captioned:
        rows = [f"{t[0]} ({t[1]})" if len(t) == 2 else (t[0] if t else "") for t in texts]   # "<prompt> (reward <r>)"
        rows = ["; ".join(r for r in (row, *more) if r) for row, more in zip(rows, extra)]
        atomic_write_text(path.with_suffix(".txt"), "".join(f"{i}: {row}\n" for i, row in enumerate(rows)))


def _grid(images: np.ndarray, ncol: int, scale: int, texts: list[list[str]], extra: list[list[str]],
          captioned: bool):
    """The PIL grid picture of uint8 ``images [N, H, W, 3]`` with their caption lines (:func:`save_grid`)."""
    from PIL import Image, ImageDraw, ImageFont

    n, h, w, _ = images.shape
    ch, cw = h * scale, w * scale
    font = ImageFont.load_default()
    lines = [[l for t in text + more for l in _wrap(t, font, cw)] for text, more in zip(texts, extra)]
    line_h = font.getbbox("Ag")[3] + 3
    cell_h = ch + max(len(l) for l in lines) * line_h + (2 if captioned else 0) + scale   # image, caption, gap
    ncol = min(ncol, n)
    grid = np.full((math.ceil(n / ncol) * cell_h + scale, ncol * (cw + scale) + scale, 3), 255, dtype=np.uint8)
    corners = [(scale + (i % ncol) * (cw + scale), scale + (i // ncol) * cell_h) for i in range(n)]
    for (x, y), image in zip(corners, images):
        grid[y:y + ch, x:x + cw] = image.repeat(scale, 0).repeat(scale, 1)
    img = Image.fromarray(grid)
    draw = ImageDraw.Draw(img)
    for (x, y), cell_lines in zip(corners, lines):
        for k, line in enumerate(cell_lines):
            draw.text((x, y + ch + 2 + k * line_h), line, fill=(0, 0, 0), font=font)
    return img


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")   # what save_grid writes, by the name


def image_format(path: Path) -> str:
    """PIL's format name of an image file, from its suffix (:data:`IMAGE_SUFFIXES`)."""
    from PIL import Image

    suffix = Path(path).suffix.lower()
    if suffix not in IMAGE_SUFFIXES:
        raise ValueError(f"{path}: an image file must end in one of {', '.join(IMAGE_SUFFIXES)}; got "
                         f"{suffix or 'no extension'!r}")
    return Image.registered_extensions()[suffix]


def _wrap(text: str, font, width: int) -> list[str]:
    """``text`` split at spaces into lines at most ``width`` pixels wide (a longer single word gets its own line)."""
    lines: list[str] = []
    for word in text.split():
        if lines and font.getlength(f"{lines[-1]} {word}") <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return lines
