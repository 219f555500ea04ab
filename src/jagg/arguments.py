"""The command line's shared arguments: the options several commands take alike (``jagg sample``, ``jagg eval``,
the lab's ``paired``, every ``--overwrite``), one definition each, so that they refuse the same values, and how every
command reports a failure (:func:`run_command`). :mod:`jagg.cli`, :mod:`jagg.bench` and the lab (``python -m lab``)
import them from here (nothing imports :mod:`jagg.cli` but the entry point)."""

from __future__ import annotations

import sys
from typing import Callable

from .checks import number_arg


def run_command(command: str, run: Callable, args) -> int:
    """``run(args)`` as the command ``command`` (e.g. ``"jagg train"``) ends for a user: a refusal (bad input, a run
    directory or file that may not be used: ``ValueError``, ``OSError``) is one line on stderr and exit 2 (under a
    launcher repeated after the launcher's report), a run that aborted (:class:`jagg.trainers.loop.TrainingAborted`)
    one line and exit 1, out of memory one line and exit 2, Ctrl-C one line and exit 130; anything else is a bug and
    keeps its traceback."""
    try:
        return run(args)
    except KeyboardInterrupt as e:    # Ctrl-C anywhere: setup, a benchmark, an evaluation
        print(f"\n{command}: interrupted{f' ({e})' if str(e) else ''}", file=sys.stderr)
        return 130
    except ValueError as e:           # incl. RewardError and RunDirError: a message, not a traceback
        return _refused(f"{command}: error: {one_screen(str(e))}")
    except OSError as e:              # a file or directory that cannot be read or written: one line, exit 2
        return _refused(f"{command}: error: {one_screen(os_error(e))}")
    except MemoryError as e:
        print(f"{command}: error: out of memory{f' ({e})' if str(e) else ''}; lower the sizes (batch, steps, model)",
              file=sys.stderr)
        return 2
    except RuntimeError as e:
        from .trainers.loop import TrainingAborted

        if isinstance(e, TrainingAborted):
            print(f"{command}: aborted: {one_screen(str(e))}", file=sys.stderr)
            return 1
        if any(s in str(e).lower() for s in ("can't allocate memory", "out of memory", "storage size calculation "
                                             "overflowed")):   # torch's allocators: a size no memory holds
            print(f"{command}: error: out of memory ({' '.join(str(e).split())[:200]}); lower the sizes (batch, "
                  "steps, model)", file=sys.stderr)
            return 2
        raise


def _refused(line: str) -> int:
    """A refusal: ``line`` on stderr (under a launcher said again after the launcher's own report of the failed
    processes, :func:`jagg.infra.after_launch.say_after_launcher`); exit status 2."""
    from .infra.after_launch import say_after_launcher

    print(line, file=sys.stderr)
    say_after_launcher(line)
    return 2


SCREEN = 2000                         # the most characters a refusal prints: a screen


def one_screen(text: str, limit: int = SCREEN) -> str:
    """``text`` when it fits a screen (``limit`` characters), else its start and end around a note of what was cut:
    a refusal never prints a value's every element (the checks show long values short, :func:`jagg.checks.shown`;
    this bounds the others)."""
    if len(text) <= limit:
        return text
    cut = len(text) - limit + 200
    return f"{text[:limit - 600]} [... {cut} characters cut ...] {text[-400:]}"


def os_error(e: OSError) -> str:
    """An ``OSError`` as one line naming the path and what to do (``read_yaml`` and others raise their own text)."""
    if e.errno is None or e.strerror is None:
        return " ".join(str(e).split())
    path = f" {e.filename}" if e.filename is not None else ""
    path += f" -> {e.filename2}" if e.filename2 is not None else ""
    return (f"cannot use{path}: {e.strerror} (errno {e.errno}); check that the path exists, is the right kind (file "
            "or directory) and is writable, or choose another --output-dir / --out")


def config_arguments(p, what: str, example: str = "sample.eta=0.3", main_job: bool = True) -> None:
    """The ``--config`` / ``--set`` pair of every command that reads a trainer config (``jagg bench meter | speed`` and
    the lab's tools), one definition: ``--config PATH`` a trainer YAML, ``what`` saying what the command does with it
    (one with a ``pipeline:`` section is a real model's); ``--set KEY=VALUE`` overrides a key, repeatable (``example``
    in its help). ``main_job``: without ``--config``, the main job (jagg/shapes/main_job.yaml); else none."""
    from .trainers.shapes_config import main_job_path

    default = str(main_job_path()) if main_job else None
    shown = " [default: the main job, jagg/shapes/main_job.yaml]" if main_job else ""
    p.add_argument("--config", default=default, metavar="PATH", help=f"trainer YAML: {what}{shown}")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override a config key (repeatable), e.g. {example}")


def main_job_defaults(args, eval_seed: bool) -> None:
    """Fill the sampling options left unset (None) with the main job's evaluation settings (``jagg sample``,
    ``jagg eval``, ``python -m lab paired``); the seed is the main job's ``eval.seed`` when ``eval_seed``, else 0."""
    from .trainers.shapes_config import ShapesTrainConfig, main_job_path
    from .infra import config_loader as configuration

    main = configuration.load(ShapesTrainConfig, str(main_job_path()), [])
    defaults = {"steps": main.eval.num_steps, "guidance_scale": main.sample.guidance_scale, "shift": main.sample.shift,
                "seed": main.eval.seed if eval_seed else 0,
                "images_per_prompt": main.eval.images_per_prompt,
                "reward": main.reward.spec}
    for k, v in defaults.items():
        if getattr(args, k, v) is None:
            setattr(args, k, v)


def eval_prompts(num_prompts: int, flag: str) -> int:
    """The test prompts an evaluation of ``num_prompts`` (0 = all) uses; more than the test split holds is refused,
    naming ``flag``."""
    from .shapes import test_prompts

    available = len(test_prompts())
    if num_prompts > available:
        raise ValueError(f"{flag} {num_prompts} is more than the {available} prompts of the test split; lower it "
                         "(0 = all of them)")
    return num_prompts or available


def check_sampling(args, images: int, what: str, fix: str) -> None:
    """The sampling options of ``jagg sample``, ``eval`` and ``bench paired`` checked together before any model loads:
    ``--shift`` keeps the ``--steps`` schedule's sigmas distinct, and ``images`` images (``what``) fit this machine's
    memory (:mod:`jagg.infra.sizes`; ``fix``: what to lower)."""
    from .schedule import check_schedule
    from .infra.sizes import check_memory, check_steps, check_time, images_bytes

    check_steps(args.steps, "--steps")
    check_memory(images_bytes(images), f"{what}: {images} images", fix)
    check_time(float(images) * args.steps, f"{what} x --steps {args.steps}: {images} images'", f"{fix}, or --steps")
    check_schedule(args.steps, args.shift, "--shift", "--steps")


def sampling_arguments(q, checkpoint: bool = True) -> None:
    """The ODE sampler's options of ``jagg sample``, ``jagg eval`` and ``python -m lab paired`` (and ``--checkpoint``):
    one definition, so that they refuse the same values; None is the main job's evaluation setting
    (:func:`main_job_defaults`)."""
    if checkpoint:
        q.add_argument("--checkpoint", default="builtin:tiny_dit",
                       help="builtin:tiny_dit, a .safetensors, a training checkpoint .pt or a run directory (a "
                       "real-model run's too: its model, adapter and EMA)")
    q.add_argument("--steps", type=number_arg(int, 1), help="ODE sampling steps [default: the main job's eval.num_steps]")
    q.add_argument("--guidance-scale", type=number_arg(float),
                   help="classifier-free guidance scale [default: the main job's sample.guidance_scale]")
    q.add_argument("--shift", type=number_arg(float, 0, strict=True),
                   help="SD3 timestep shift [default: the main job's sample.shift]")
    q.add_argument("--seed", type=number_arg(int, seed=True),
                   help="noise seed, 0 to 2**32 - 1 [default: 0; eval and bench paired: the main job's eval.seed]")


MAIN_JOB_REWARD = "geneval"      # the main job's reward.name; tests/test_commands_show_what_runs.py checks it against the file


def evaluation_arguments(q) -> None:
    """The evaluation's options of ``jagg eval`` and ``python -m lab paired``: the reward and the images per prompt."""
    q.add_argument("--reward", help="reward name or module:function [default: the main job's reward "
                   f"(reward: of jagg/shapes/main_job.yaml), {MAIN_JOB_REWARD}]")
    q.add_argument("--images-per-prompt", type=number_arg(int, 1),
                   help="images per test prompt [default: the main job's eval.images_per_prompt]")


def overwrite_argument(q, what: str) -> None:
    """``--overwrite``: replace the command's existing output file(s) ``what``; without it they are refused."""
    q.add_argument("--overwrite", action="store_true", help=f"replace {what} if it exists (without it an existing "
                   "file is refused before any work)")
