"""How often the real-model trainer's path changes source file, from ``jagg train`` to the first optimizer step.

Builds a tiny random SD3 pipeline (two tiny CLIP text encoders, no T5; the builders of tests/tiny_pipelines.py) in a
temporary directory, writes a LoRA training config for it, and runs ``jagg train --config <it>`` under
``sys.setprofile``. A call of a function defined inside the ``jagg`` package moves "the current file" to
that function's file, its return moves it back to the file of the nearest ``jagg`` caller; each move to another
file counts as one change (frames outside ``jagg``, e.g. torch and diffusers, are transparent). What runs while a
``jagg`` module is being imported is left out by default: that is the import graph rather than the call path
(``--imports`` counts it too).
Tracing stops at the first ``optimizer.step()``; a run that is refused (``--correction-p 2``) or ends before it makes
the tool exit 2 with the refusal, counting nothing.

    python -m lab trace-file-changes [--correction-p P] [--skip-checks] [--path] [--json out.json [--overwrite]]

``--skip-checks`` makes ``jagg.checks`` transparent too (its calls move nothing): the shared checks aside.

Prints the number of file changes, the number of distinct files visited, and the files most often entered;
``--path`` also prints every change (the JSON always holds them, as ``path``).
Needs the test extras (diffusers, peft, transformers). CPU only, a few seconds.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import torch

from jagg.arguments import overwrite_argument
from jagg.checks import check_output_file, number_arg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


class _FirstStep(Exception):
    pass


def tiny_sd3_dir(path: Path) -> Path:
    from tiny_pipelines import save_sd3_pipeline          # tests/tiny_pipelines.py (ROOT/tests is on sys.path)

    return save_sd3_pipeline(path)


def write_config(tmp: Path, model_dir: Path, correction_p: float = 0.0) -> Path:
    (tmp / "prompts.txt").write_text("a red cube\na blue ball\n")
    cfg = tmp / "sd3.yaml"
    cfg.write_text(f"""\
pipeline:
  family: sd3
  path: {model_dir}
  dtype: fp32
  device: cpu
  resolution: 128
  num_steps: 4
  max_sequence_length: 8
  lora: {{enabled: true, rank: 2}}
reward: {{name: jpeg_compressibility}}
sample: {{prompts_file: {tmp / "prompts.txt"}, prompts_per_iter: 2, group_size: 2, micro_batch: 4}}
estimator: {{mode: jagg, window: 3, micro_batch: 4, correction_p: {correction_p}}}
grpo: {{iterations: 1, updates_per_epoch: 1, drop_zero_spread: false}}
log: {{output_dir: {tmp / "run"}, checkpoint_every: 0, tensorboard: false, progress: false}}
threads: 1
""")
    return cfg


def trace(config: Path, imports: bool = False, skip_checks: bool = False) -> dict:
    import jagg
    from jagg.cli import main

    pkg = str(Path(jagg.__file__).resolve().parent)
    changes, current = 0, None
    entered = collections.Counter()
    path: list[str] = []  # one "file:function" per change, the function that moved the current file

    checks = str(Path(pkg) / "checks") + "/"                     # the package jagg.checks

    def in_jagg(frame) -> bool:
        f = frame.f_code.co_filename
        return f.startswith(pkg) and not (skip_checks and f.startswith(checks))

    def importing(frame) -> bool:
        while frame is not None:
            if frame.f_code.co_name == "<module>" and in_jagg(frame):
                return True
            frame = frame.f_back
        return False

    def caller_file(frame) -> str | None:
        while frame is not None and not in_jagg(frame):
            frame = frame.f_back
        return None if frame is None else frame.f_code.co_filename

    def profile(frame, event, arg):
        nonlocal changes, current
        if event not in ("call", "return") or not in_jagg(frame) or (not imports and importing(frame)):
            return
        f = frame.f_code.co_filename if event == "call" else caller_file(frame.f_back)
        if f is None or f == current:
            return
        if current is not None:
            changes += 1
        path.append(f"{'->' if event == 'call' else '<-'} {f}:{frame.f_code.co_name if event == 'call' else frame.f_back.f_code.co_name}")
        current = f
        entered[f] += 1

    def stop(optimizer, args, kwargs):
        sys.setprofile(None)
        raise _FirstStep

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(stop)
    sys.setprofile(profile)
    try:
        code = main(["train", "--config", str(config)])
    except _FirstStep:
        code = None
    finally:
        sys.setprofile(None)
        handle.remove()
    if code is not None:                 # refused or ended before its first step: the path is not the trainer's
        raise ValueError(f"the traced `jagg train` exited {code} before its first optimizer step (its error is "
                         "above), so there is no trainer's path to count; fix what it refused")
    rel = lambda f: str(Path(f).relative_to(Path(pkg).parent))
    return {"file_changes": changes, "files_visited": len(entered),
            "entered": {rel(f): n for f, n in entered.most_common()},
            "path": [p.replace(pkg + "/", "") for p in path]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab trace-file-changes", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="also write the result here")
    p.add_argument("--imports", action="store_true", help="count the module bodies run at import time too")
    p.add_argument("--path", action="store_true",
                   help="also print every change: '->' FILE:FUNCTION for a call into another file, '<-' FILE:FUNCTION "
                        "for a return to the caller FUNCTION in FILE")
    p.add_argument("--skip-checks", action="store_true",
                   help="leave the calls into jagg.checks out (transparent, as torch is): the shared checks aside")
    p.add_argument("--correction-p", type=number_arg(float, 0.0), default=0.0,
                   help="estimator.correction_p of the traced run [default: 0, plain JAGG; 0.25 adds the correction's "
                        "calls]")
    overwrite_argument(p, "--json")
    args = p.parse_args(argv)
    if args.json:
        check_output_file(args.json, "--json", args.overwrite)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        result = trace(write_config(tmp, tiny_sd3_dir(tmp / "sd3"), args.correction_p), args.imports, args.skip_checks)
    print(f"source-file changes from `jagg train` to the first optimizer step: {result['file_changes']}")
    print(f"distinct files: {result['files_visited']}")
    for f, n in list(result["entered"].items())[:12]:
        print(f"  {n:5d}  {f}")
    if args.path:
        for i, step in enumerate(result["path"]):
            print(f"  {i:4d}  {step}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
