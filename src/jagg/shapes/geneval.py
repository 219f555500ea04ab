"""A verifiable GenEval-like reward for the shapes world.

GenEval scores an image against its prompt with an object detector. In the shapes world the detector can be
a handful of rules instead, and it should be: rules are exact on rendered ground truth, deterministic, need
no training data or weights, are fast on a CPU, and every decision can be checked by hand, so a rising reward
means the generator got better, not that it found a detector's blind spot. Generated images are noisy and
blurry, so every rule has slack: pixels far from every palette colour are ignored, and so are components
smaller than `min_area`.

Detection, for uint8 images [N, H, W, 3]:
  1. colour segmentation: each pixel takes its nearest palette colour (or the background) if within
     `color_threshold` (RGB Euclidean distance), else it is ignored;
  2. connected components (4-connected, same colour), found for the whole batch at once by min-label
     propagation with pointer jumping; components under `min_area` pixels (at 32x32, scaled with H*W)
     are dropped;
  3. shape from two numbers per component: fill = area / bounding-box area (square 1, disc ~pi/4,
     triangle ~1/2) and low = height of the centroid in the box (1/2 for symmetric shapes, ~2/3 for an
     upright triangle):
        triangle  if low >= 0.575
        square    elif fill >= 0.93, or fill >= 0.85 and at least 3 of the 4 box-corner pixels are set
                  (a small pixelated disc is a square missing its corners)
        circle    otherwise
     and "unknown" (still counted as an object) if fill < 0.35 or the box's aspect exceeds `max_aspect`.
     On rendered scenes (objects 9-13 px at 32x32) the margins are wide: disc fill <= 0.92 and low <= 0.55;
     triangles have low >= 0.6; squares keep fill >= 0.95 even after a mild blur.

Scoring. A prompt becomes a list of constraints, each true or false:
  shape:<s>    the number of detected <s> equals the number of <s> the prompt asks for (any colour);
  color:<i>    for each object spec i with a colour: the number of detected objects with that colour and
               shape equals its count;
  relation     (position prompts): each of the two object specs matches exactly one detection, and the
               first centroid lies past the second along the relation's axis by more than
               `margin` * W pixels ("left of": x_first < x_second - margin * W; y points down);
  no_extra     the total number of detected objects equals the number the prompt asks for.
score = fraction of constraints satisfied (1.0 exactly when the prompt is fully satisfied); correct = all
satisfied. E.g. "a red square and a blue circle" has 5 constraints (shape:square, shape:circle, color:0,
color:1, no_extra): the colour-swapped image scores 3/5 and is not correct.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..rewards.images import to_uint8
from ..rewards.registry import register_reward
from .scene import BACKGROUND, CATEGORIES, COLORS, PromptSpec, parse_prompt

_NAMES = tuple(COLORS)
_PALETTE = np.array([BACKGROUND, *COLORS.values()], dtype=np.float32)  # [C + 1, 3]; row 0 = background


class Detection(NamedTuple):
    color: str
    shape: str          # "circle" | "square" | "triangle" | "unknown"
    cx: float           # centroid, pixels (x right, y down)
    cy: float
    area: int           # pixels


def segment(images: np.ndarray, threshold: float) -> np.ndarray:
    """uint8 [N, H, W, 3] -> int64 [N, H, W]: index into COLORS, or -1 for background / ignored."""
    x = images.astype(np.float32)
    d2 = np.zeros(images.shape[:3] + (len(_PALETTE),), np.float32)
    for ch in range(3):
        d2 += (x[..., ch, None] - _PALETTE[:, ch]) ** 2
    idx = d2.argmin(-1)
    ok = np.take_along_axis(d2, idx[..., None], -1)[..., 0] <= threshold ** 2
    return np.where(ok, idx - 1, -1)


def connected_components(labels: np.ndarray) -> np.ndarray:
    """int [N, H, W] colour labels (-1 = none) -> int64 [N, H, W]: for each labelled pixel the flat index
    (into labels.ravel()) of the first pixel of its 4-connected same-label component; -1 elsewhere."""
    fg = labels >= 0
    big = labels.size
    comp = np.where(fg, np.arange(labels.size).reshape(labels.shape), big)
    same_x = fg[:, :, 1:] & (labels[:, :, 1:] == labels[:, :, :-1])   # pixel and its right neighbour
    same_y = fg[:, 1:, :] & (labels[:, 1:, :] == labels[:, :-1, :])   # pixel and the one below
    flat_fg = fg.ravel()
    while True:
        new = comp.copy()
        np.minimum(new[:, :, :-1], np.where(same_x, comp[:, :, 1:], big), out=new[:, :, :-1])
        np.minimum(new[:, :, 1:], np.where(same_x, comp[:, :, :-1], big), out=new[:, :, 1:])
        np.minimum(new[:, :-1, :], np.where(same_y, comp[:, 1:, :], big), out=new[:, :-1, :])
        np.minimum(new[:, 1:, :], np.where(same_y, comp[:, :-1, :], big), out=new[:, 1:, :])
        flat = new.ravel()
        for _ in range(4):  # pointer jumping: a label is a pixel of the same component with a smaller index
            flat[flat_fg] = flat[flat[flat_fg]]
        if np.array_equal(new, comp):
            return np.where(fg, comp, -1)
        comp = new


@dataclass
class GenevalReward:
    """GenEval-like reward for the shapes world; see the module docstring for the exact rules.

    Call: (images uint8 [N, H, W, 3] or float tensor [N, 3, H, W] in [-1, 1], prompts: list[str],
    metadata: list[dict] | None, unused) -> (scores float32 [N] in [0, 1], info) with info:
      correct       bool [N]: every constraint satisfied
      category      list[str] [N]: GenEval category of each prompt
      constraints   list[dict[str, bool]] [N]
      num_objects   int [N]: detected objects
      accuracy/<category>  float: mean correct over the batch items of that category (present ones only)
    """

    color_threshold: float = 90.0
    min_area: float = 6.0          # pixels at 32x32; scaled by H * W / 32**2
    max_aspect: float = 1.6
    margin: float = 0.03           # position margin, fraction of the image width

    def __call__(self, images, prompts: list[str], metadata: list[dict] | None = None):
        images = to_uint8(images)
        if len(prompts) != len(images):
            raise ValueError(f"geneval: got {len(images)} images but {len(prompts)} prompts")
        specs = [parse_prompt(p) for p in prompts]
        detections = self.detect(images)
        width = images.shape[2]
        constraints = [self.constraints(s, d, width) for s, d in zip(specs, detections)]
        scores = np.array([np.mean(list(c.values())) for c in constraints], dtype=np.float32)
        correct = np.array([all(c.values()) for c in constraints], dtype=bool)
        category = [s.category for s in specs]
        info = {"correct": correct, "category": category, "constraints": constraints,
                "num_objects": np.array([len(d) for d in detections], dtype=np.int64)}
        for cat in CATEGORIES:
            mask = np.array([c == cat for c in category], dtype=bool)
            if mask.any():
                info[f"accuracy/{cat}"] = float(correct[mask].mean())
        return scores, info

    def detect(self, images) -> list[list[Detection]]:
        """Objects in each image: images as in __call__ -> N lists of Detection."""
        images = to_uint8(images)
        n, h, w, _ = images.shape
        labels = segment(images, self.color_threshold)
        comp = connected_components(labels).ravel()
        pix = np.flatnonzero(comp >= 0)
        out: list[list[Detection]] = [[] for _ in range(n)]
        if pix.size == 0:
            return out
        roots, inv = np.unique(comp[pix], return_inverse=True)
        area = np.bincount(inv)
        ys, xs = (pix % (h * w)) // w, pix % w
        x0, x1, y0, y1 = (np.full(len(roots), v) for v in (w, -1, h, -1))
        np.minimum.at(x0, inv, xs), np.maximum.at(x1, inv, xs)
        np.minimum.at(y0, inv, ys), np.maximum.at(y1, inv, ys)
        bw, bh = x1 - x0 + 1, y1 - y0 + 1
        cx, cy = np.bincount(inv, weights=xs) / area, np.bincount(inv, weights=ys) / area
        base = roots - roots % (h * w)
        corners = sum(comp[base + yy * w + xx] == roots for yy in (y0, y1) for xx in (x0, x1))  # box corners owned
        fill = area / (bw * bh)
        low = (cy + 0.5 - y0) / bh                   # centroid height in the box: 1/2 symmetric, 2/3 triangle
        square = (fill >= 0.93) | ((fill >= 0.85) & (corners >= 3))
        shape = np.where(low >= 0.575, "triangle", np.where(square, "square", "circle")).astype(object)
        shape[(fill < 0.35) | (np.maximum(bw, bh) > self.max_aspect * np.minimum(bw, bh))] = "unknown"
        cx, cy = cx + 0.5, cy + 0.5
        keep = area >= self.min_area * h * w / 32 ** 2
        color = labels.ravel()[roots]
        for k in np.flatnonzero(keep):
            out[roots[k] // (h * w)].append(
                Detection(_NAMES[color[k]], shape[k], float(cx[k]), float(cy[k]), int(area[k])))
        return out

    def constraints(self, spec: PromptSpec, dets: list[Detection], width: int) -> dict[str, bool]:
        """The constraints of `spec` (see the module docstring), checked against one image's detections."""
        c: dict[str, bool] = {}
        for s in dict.fromkeys(o.shape for o in spec.objects):
            c[f"shape:{s}"] = sum(d.shape == s for d in dets) == sum(o.count for o in spec.objects if o.shape == s)
        for i, o in enumerate(spec.objects):
            if o.color is not None:
                c[f"color:{i}"] = sum(o.matches(d.color, d.shape) for d in dets) == o.count
        if spec.relation is not None:
            found = [[d for d in dets if o.matches(d.color, d.shape)] for o in spec.objects]
            ok = all(len(f) == 1 for f in found)
            if ok:
                a, b = found[0][0], found[1][0]
                m = self.margin * width
                ok = {"left_of": a.cx < b.cx - m, "right_of": a.cx > b.cx + m,
                      "above": a.cy < b.cy - m, "below": a.cy > b.cy + m}[spec.relation]
            c["relation"] = bool(ok)
        c["no_extra"] = len(dets) == sum(o.count for o in spec.objects)
        return c


register_reward("geneval", GenevalReward)      # the world registers its reward: `reward.name: geneval` in a config
