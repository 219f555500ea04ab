"""The ``jagg`` command line: train, pretrain, sample, eval (and bench, see ``jagg bench --help``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .arguments import (check_sampling, eval_prompts, evaluation_arguments, main_job_defaults, overwrite_argument,
                        run_command, sampling_arguments)
from .checks import check_output_file, check_threads, number_arg
from .infra import config_loader as configuration
from .infra.distributed import exit_process
from .shapes.pretrain import PretrainConfig
from .trainers.diffusers_config import DiffusersTrainConfig, has_pipeline_section, load_config
from .trainers.shapes_config import ShapesTrainConfig, main_job_path


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose ``epilog_fn`` (if set) builds the epilog only when the help is shown: listing every
    config key walks the config dataclasses, which a run does not need."""

    epilog_fn = None

    def format_help(self) -> str:
        if self.epilog_fn is not None:
            self.epilog, self.epilog_fn = self.epilog_fn(), None
        return super().format_help()


def _value(cfg, key: str):
    """The value of the dotted config ``key`` in the loaded config ``cfg``, as YAML would hold it."""
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    if dataclasses.is_dataclass(value):
        return configuration.to_dict(value)
    return list(value) if isinstance(value, tuple) else value


_UNSET = object()


def _keys_epilog(cls, value_of=None, title: str = "config keys", how: str = "set in YAML or with --set key=value") -> str:
    """Every config key of ``cls`` with its help; with ``value_of(key)`` (the value the config runs, or ``_UNSET`` for
    a key it leaves out) that value and the dataclass default beside it where they differ, else the default."""
    rows = configuration.describe(cls)
    width = max(len(k) for k, _, _ in rows)
    lines = []
    for k, d, h in rows:
        v = _UNSET if value_of is None else value_of(k)
        if v is _UNSET:
            shown = f"[default: {d}]" if value_of is None else f"[{d}]"
        else:
            shown = f"[{v!r}]" if repr(v) == d else f"[{v!r}; dataclass default: {d}]"
        lines.append(f"  {k:<{width}}  {h} {shown}")
    return f"{title} ({how}):\n" + "\n".join(lines)


def _raw_value(data: dict, key: str):
    """The value of the dotted ``key`` as written in a config mapping, or ``_UNSET``."""
    node = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _UNSET
        node = node[part]
    return node


def _config_keys(config: str, sets: list[str]) -> str:
    """``jagg train --help-config``: every config key with its help and the value ``config`` (after ``sets``) runs,
    the dataclass default beside it where they differ; then the other trainer's keys."""
    where = "the main job, " + str(main_job_path()) if config == str(main_job_path()) else config
    after = f" and {len(sets)} --set" if sets else ""
    note = ""
    try:
        data = configuration.apply_overrides(configuration.read_yaml(config), sets)
    except (ValueError, OSError) as e:
        note = f"(cannot read {config}: {' '.join(str(e).split())}; the dataclass defaults are shown)\n"
        text = note + _keys_epilog(ShapesTrainConfig)
        return text + "\n\nwith a pipeline: section (real models), " + _keys_epilog(DiffusersTrainConfig)
    real = has_pipeline_section(data)
    cls = DiffusersTrainConfig if real else ShapesTrainConfig
    try:
        cfg = load_config(config, sets) if real else configuration.load(ShapesTrainConfig, config, sets)
        value_of = lambda key: _value(cfg, key)
    except (ValueError, OSError) as e:     # e.g. a required prompts file not given yet: the values as written
        note = (f"(the config does not load yet: {' '.join(str(e).split())}; values as written, the dataclass "
                "default where the YAML leaves a key out)\n")
        value_of = lambda key: _raw_value(data, key)
    how = ("[value] is what runs with " + where + after + "; a key the YAML leaves out takes the dataclass default; "
           "set keys in a YAML file (--config) or with --set key=value")
    if real:
        return note + _keys_epilog(cls, value_of, "config keys of the diffusers trainer (pipeline: section)", how)
    text = note + _keys_epilog(cls, value_of, "config keys of the shapes (TinyDiT) trainer", how)
    return text + "\n\nwith a pipeline: section (real models), " + _keys_epilog(DiffusersTrainConfig)


@dataclass
class PretrainRunConfig:
    """``jagg pretrain``: the TinyDiT architecture and the optimisation (the output file is ``--out``)."""

    threads: int = field(default=0, metadata={"help": "torch CPU threads (0 = torch's default)."})
    snapshot_every: int = field(default=0, metadata={"help": "Also save <out>.step<N>.safetensors every N steps "
                                                     "(the EMA weights when train.ema_decay is set; 0 = off)."})
    model: dict = field(default_factory=dict, metadata={"help": "TinyDiT architecture overrides (DiTConfig keys), "
                                                        "e.g. {dim: 128, depth: 4}."})
    train: PretrainConfig = field(default_factory=PretrainConfig)

    def __post_init__(self):
        check_threads(self.threads, "threads")
        if self.snapshot_every < 0:
            raise ValueError(f"snapshot_every must be >= 0 (0 = off); got {self.snapshot_every}")
        self.model_config()                          # the architecture's keys checked as any config's, at load

    def model_config(self):
        """The TinyDiT's :class:`jagg.shapes.dit.DiTConfig`: the shipped vocabulary and the ``model`` overrides."""
        from .shapes import tokenizer
        from .shapes.dit import DiTConfig

        return configuration.from_dict(DiTConfig, {"vocab_size": tokenizer.vocab_size, **self.model}, "model")


def _check_wandb(cfg) -> None:
    """With ``log.wandb``, wandb's start-up checks (project, mode, API key) before anything is written or printed."""
    if cfg.log.wandb:
        from .infra.wandb_run import check_start

        check_start(cfg.log)


def _train(args) -> int:
    """``jagg train``: the config (the main job by default; a ``pipeline:`` section: a real diffusers model), printed
    (``--print-config``) or trained by its trainer's ``run`` (:meth:`jagg.trainers.loop.GRPOTrainer.run`)."""
    overrides = list(args.set or [])
    if args.output_dir is not None:                  # '' is refused by log.output_dir's check, not ignored
        overrides.append(f"log.output_dir={args.output_dir}")
    config = str(main_job_path()) if args.config is None else args.config
    if args.help_config:
        print(_config_keys(config, overrides))
        return 0
    data = configuration.read_yaml(config)       # read once
    real = "pipeline" in data                    # a real diffusers model (has_pipeline_section): jagg.trainers.diffusers_trainer
    load = lambda: configuration.load(DiffusersTrainConfig if real else ShapesTrainConfig, overrides=overrides,
                                      data=data)
    if args.print_config:                        # a required input left unset is marked, not refused
        cfg, unset = configuration.load_for_print(load)
        _check_wandb(cfg)                        # what train would refuse at start-up is refused here too
        print(f"# resolved by jagg train --print-config from {config!r} and {len(overrides)} --set override(s)"
              + (f"; {len(unset)} required input(s) unset, marked REQUIRED: set them to train" if unset else ""))
        print(configuration.dump(cfg, unset), end="")
        return 0
    cfg = load()
    _check_wandb(cfg)
    if real:
        from .trainers.diffusers_trainer import DiffusersTrainer as Trainer
    else:
        from .trainers.shapes_trainer import ShapesTrainer as Trainer
    # --resume: the run's checkpoint must be there; --resume-or-start: or no run at all (a new one starts)
    Trainer.run(cfg, resume=args.resume or args.resume_or_start, require_checkpoint=args.resume,
                overwrite=args.overwrite)
    return 0


def _pretrain_out(out: str, overwrite: bool, steps: int, snapshot_every: int) -> Path:
    """``jagg pretrain --out``, checked before training: a new ``.safetensors`` file (an existing one only with
    ``--overwrite``, and so its ``.step<N>`` snapshots), never inside the jagg package (its shapes/assets/ holds the
    shipped model)."""
    path = Path(out)
    package = Path(__file__).resolve().parent
    target = path.resolve()
    if target == package or package in target.parents:
        raise ValueError(f"--out {out} is inside the installed jagg package ({package}); its "
                         "shapes/assets/tiny_dit.safetensors is the shipped model that builtin:tiny_dit, the main job and "
                         "the tests load. Write elsewhere (e.g. --out runs/pretrain/tiny_dit.safetensors) and copy the "
                         "file over the asset yourself if you mean to replace it")
    check_output_file(out, "--out", overwrite, (".safetensors",))
    if snapshot_every and not overwrite and path.parent.is_dir():
        snapshot = re.compile(rf"{re.escape(path.stem)}\.step(\d+)\.safetensors")
        taken = sorted(str(p) for p in path.parent.iterdir() if (m := snapshot.fullmatch(p.name))
                       and int(m.group(1)) % snapshot_every == 0 and int(m.group(1)) < steps)
        if taken:
            raise ValueError(f"--out {out}: snapshot_every={snapshot_every} would replace {', '.join(taken)}; "
                             "pass --overwrite to replace them, or choose another --out")
    return path


def _pretrain(args) -> int:
    import torch

    from .shapes.dit import TinyDiT, save_pretrained
    from .shapes.pretrain import pretrain
    from .shapes.data import WorldBatches

    run = configuration.load(PretrainRunConfig, None, args.set or [])
    train = run.train
    out = _pretrain_out(args.out, args.overwrite, train.steps, run.snapshot_every)
    if run.threads:
        torch.set_num_threads(run.threads)
    torch.manual_seed(train.seed)
    mcfg = run.model_config()
    model = TinyDiT(mcfg)
    print(f"TinyDiT: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; {train.steps} steps")
    def log(record: dict) -> None:
        print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in record.items()}), flush=True)

    def snapshot(step: int, weights: torch.nn.Module) -> None:
        save_pretrained(weights, out.with_suffix(f".step{step}.safetensors"))

    pretrain(model, WorldBatches(mcfg.image_size, mcfg.max_text_len), train, log, snapshot, run.snapshot_every)
    save_pretrained(model, out)
    print(f"wrote {out}")
    return 0


def _real_run(args):
    """The checkpoint of a real-model run that ``--checkpoint`` names (:mod:`jagg.trainers.trained_run`), or None."""
    from .trainers.trained_run import diffusers_checkpoint

    return diffusers_checkpoint(args.checkpoint)


def _sample(args) -> int:
    real = _real_run(args)
    if real is not None:
        from .infra.metrics import IMAGE_SUFFIXES
        from .trainers.trained_run import sample_run

        check_output_file(args.out, "--out", args.overwrite, (*IMAGE_SUFFIXES, ".gif"))
        check_output_file(Path(args.out).with_suffix(".txt"), f"--out {args.out}'s captions", args.overwrite)
        return sample_run(real, args)
    from .infra.config_loader import read_prompt_lines
    from .shapes import tokenizer
    from .shapes.weights import load_model
    from .shapes.evaluation import generate
    from .infra.metrics import IMAGE_SUFFIXES, save_grid

    out = check_output_file(args.out, "--out", args.overwrite, IMAGE_SUFFIXES)
    check_output_file(out.with_suffix(".txt"), f"--out {out}'s captions", args.overwrite)
    prompts = list(args.prompt or [])
    if args.prompt_file is not None:
        prompts += read_prompt_lines(args.prompt_file, "--prompt-file")
    if not prompts:
        raise ValueError("give at least one --prompt or a --prompt-file")
    check_sampling(args, len(prompts) * args.num_per_prompt, f"{len(prompts)} prompt(s) x --num-per-prompt "
                   f"{args.num_per_prompt}", "lower --num-per-prompt or give fewer prompts")
    model = load_model(args.checkpoint)
    try:                                             # a prompt the model cannot read: named by the option it came from
        tokenizer.encode(prompts, model.config.max_text_len)
    except ValueError as e:
        given = ([f"--prompt-file {args.prompt_file}"] if args.prompt_file else []) + (["--prompt"] if args.prompt else [])
        raise ValueError(f"{' or '.join(given)}: {e}") from None
    batch = [p for p in prompts for _ in range(args.num_per_prompt)]
    images = generate(model, batch, args.steps, args.guidance_scale, args.seed, args.shift)
    save_grid(images, out, ncol=args.num_per_prompt, prompts=batch)
    print(f"wrote {out} and its captions {out.with_suffix('.txt')} ({len(batch)} images, one row per prompt)")
    return 0


def _eval(args) -> int:
    from .shapes.weights import load_model
    from .shapes.evaluation import evaluate
    from .rewards.registry import get_reward
    from .infra.atomic import atomic_write_text

    if args.json is not None:
        check_output_file(args.json, "--json", args.overwrite)
    real = _real_run(args)
    if real is not None:
        from .trainers.trained_run import eval_run

        text = json.dumps(eval_run(real, args), indent=2)
        print(text)
        if args.json is not None:
            atomic_write_text(args.json, text + "\n")
        return 0
    if args.prompt_file is not None or args.raw_weights:
        raise ValueError(f"--{'prompt-file' if args.prompt_file is not None else 'raw-weights'} is for a real-model "
                         "run (--checkpoint <run directory>); the shapes world is evaluated on its test split")
    prompts = eval_prompts(args.num_prompts, "--num-prompts")
    check_sampling(args, prompts * args.images_per_prompt, f"{prompts} test prompts x --images-per-prompt "
                   f"{args.images_per_prompt}", "lower --images-per-prompt or --num-prompts")
    reward = get_reward(args.reward)
    metrics, _, _ = evaluate(load_model(args.checkpoint), reward, args.num_prompts, args.images_per_prompt, args.steps,
                             args.guidance_scale, args.seed, args.shift)
    metrics = {"num_prompts": prompts, "images_per_prompt": args.images_per_prompt, **metrics}   # what was evaluated
    text = json.dumps(metrics, indent=2)
    print(text)
    if args.json is not None:
        atomic_write_text(args.json, text + "\n")
    return 0


def _add_train(sub) -> None:
    """``jagg train``: the shapes trainer, or the diffusers trainer for a config with a ``pipeline:`` section."""
    t = sub.add_parser("train", help="GRPO training on the embedded shapes world, or on SD3/FLUX/Qwen-Image "
                       "(pipeline: config)",
                       description="GRPO training: the embedded TinyDiT (the main job by default), or, for a --config "
                       "with a top-level `pipeline:` section (configs/sd35_medium.yaml), that diffusers model from its "
                       "local directory (docs/real_models.md).",
                       epilog="config keys: `jagg train --help-config` lists every one with its help and the value "
                       "the config runs (after --config and --set); docs/usage.md#the-cli says more.")
    t.add_argument("--config", help="YAML config [default: the main job, jagg/shapes/main_job.yaml]")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    t.add_argument("--output-dir", metavar="DIR", help="the run directory (log.output_dir); a new run refuses one "
                   "holding a run")
    how = t.add_mutually_exclusive_group()
    how.add_argument("--resume", action="store_true", help="continue the run there from its newest checkpoint")
    how.add_argument("--resume-or-start", action="store_true", help="continue the run there, or start one")
    how.add_argument("--overwrite", action="store_true", help="start anew; an old run is moved to DIR.old-<time>")
    t.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    t.add_argument("--help-config", action="store_true", help="list every config key, its help and value; exit")
    t.set_defaults(func=_train)


def _add_pretrain(sub) -> None:
    """``jagg pretrain``: the TinyDiT on rendered shapes."""
    pt = sub.add_parser("pretrain", help="rectified-flow pretraining of the TinyDiT on rendered shapes",
                        description="Rectified-flow pretraining of the TinyDiT on rendered shapes-world images of the "
                        "train prompts. The defaults below are the recipe of the shipped builtin:tiny_dit "
                        "(docs/pretrain.md). --out is required and may not point inside the jagg package.",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    pt.epilog_fn = lambda: _keys_epilog(PretrainRunConfig, how="set with --set key=value")
    pt.add_argument("--out", required=True, help="output .safetensors (required; never inside the jagg package, "
                    "whose shapes/assets/ holds the shipped model)")
    pt.add_argument("--set", action="append", metavar="KEY=VALUE", help="e.g. train.steps=3000, model.dim=128")
    overwrite_argument(pt, "--out (and its .step<N> snapshots)")
    pt.set_defaults(func=_pretrain)


def _add_sample_and_eval(sub) -> None:
    """``jagg sample`` (prompts -> image grid) and ``jagg eval`` (the test-prompt reward) of a checkpoint."""
    real = (" A real-model run (--checkpoint <run directory> of a pipeline: config, or one of its ckpt_<n>.pt) samples "
            "its own model with its trained weights (the EMA's where it keeps one; --raw-weights: not) on its sigma "
            "grid; the options left unset take the run's values (pipeline.eval_num_steps, cfg_scale, shift, eval.seed).")
    s = sub.add_parser("sample", help="prompts -> image grid from a checkpoint",
                       description="Sample prompts with the deterministic ODE sampler into a captioned grid." + real)
    sampling_arguments(s)
    s.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    s.add_argument("--prompt-file", help="a prompt file: one prompt per line (a real-model run: also a .jsonl with "
                   "a 'prompt' field a line)")
    s.add_argument("--raw-weights", action="store_true", help="a real-model run: its trained weights, not the EMA's")
    s.add_argument("--num-per-prompt", type=number_arg(int, 1), default=4, help="images per prompt (one grid row each)")
    s.add_argument("--out", default="samples.png", help="output image (.png, .jpg, ...; its captions go to the same "
                   "name with .txt)")
    overwrite_argument(s, "--out and its .txt")
    s.set_defaults(func=_sample)

    e = sub.add_parser("eval", help="held-out test-prompt reward of a checkpoint (defaults: the main job's evaluation, so "
                       "`jagg eval --checkpoint runs/default` reproduces the trainer's test reward)",
                       description="The reward of a checkpoint on held-out test prompts, sampled with the ODE "
                       "sampler from fixed noise." + real + " It is evaluated on the run's test set (or --prompt-file, "
                       ".txt or .jsonl) with the run's reward (or --reward), as its trainer evaluates.")
    sampling_arguments(e)
    evaluation_arguments(e)
    e.add_argument("--prompt-file", help="a real-model run: the test prompts (.txt or .jsonl) instead of its test set")
    e.add_argument("--raw-weights", action="store_true", help="a real-model run: its trained weights, not the EMA's")
    e.add_argument("--num-prompts", type=number_arg(int, 0), default=0, help="test prompts (0 = all)")
    e.add_argument("--json", help="also write the metrics to this JSON file")
    overwrite_argument(e, "--json")
    e.set_defaults(func=_eval)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``jagg`` parser. With ``argv`` given, a command other than the one ``argv`` asks for (or the help) is only
    named, not built (``bench`` imports every benchmark)."""
    p = _Parser(prog="jagg", description="GRPO fine-tuning of flow-matching models with JAGG.")
    sub = p.add_subparsers(dest="command", required=True)
    wanted = lambda *names: argv is None or bool(set(argv[:1]) & {*names, "-h", "--help"})
    _add_train(sub)
    if wanted("pretrain"):
        _add_pretrain(sub)
    else:
        sub.add_parser("pretrain", add_help=False)
    if wanted("sample", "eval"):
        _add_sample_and_eval(sub)
    else:
        sub.add_parser("sample", add_help=False)
        sub.add_parser("eval", add_help=False)
    if not wanted("bench"):
        sub.add_parser("bench", help="benchmarks (jagg bench --help)", add_help=False)   # built when asked for
        return p
    try:
        from .bench import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """``jagg``: a refusal (bad input, a run directory or file that may not be used) is one line and exit 2, a run
    that aborted (:class:`jagg.trainers.loop.TrainingAborted`) one line and exit 1, Ctrl-C one line and exit 130
    (``jagg train``'s loop itself finishes the iteration, saves and exits 0): :func:`jagg.arguments.run_command`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    command = " ".join(["jagg", args.command, *([args.bench_command] if args.command == "bench" else [])])

    def run(args) -> int:
        if args.command in ("sample", "eval") and _real_run(args) is None:     # a real-model run: the run's values
            main_job_defaults(args, eval_seed=args.command == "eval")
        return args.func(args)

    return run_command(command, run, args)


def console() -> None:
    """The ``jagg`` command (and ``python -m jagg.cli``): :func:`main`, its status the process's exit status
    (:func:`jagg.infra.distributed.exit_process`: a process that ran on several CPU processes leaves without
    finalizing the interpreter)."""
    exit_process(main())


if __name__ == "__main__":
    console()
