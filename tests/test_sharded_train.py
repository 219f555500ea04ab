"""``jagg train`` on an engine: FSDP2 sharding launched by ``accelerate launch`` and ``torchrun`` on 2 CPU processes
(gloo), and the launcher's settings honoured or refused by name.

SD3, full fine-tuning with the sharded KL reference and activation checkpointing (from the accelerate config): each
rank stores half of the weights, AdamW's moments and the reference; the exported weights equal one process's after 2
iterations while one rank's only prompt group is dropped (the ranks stay in step through filler calls); resuming the
2-process run from its first checkpoint is bit-identical (2 processes, torchrun) or resharded (1 process). FLUX with
LoRA under accelerate's bf16 mixed precision: fp32 master shards, the one-process update within bf16's precision, the
gathered adapter exported. The DDP launch of LoRA (replicated) is in tests/test_real_train.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import diffusers  # noqa: E402
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel  # noqa: E402
from tiny_pipelines import embeds, tiny_flux, tiny_vae  # noqa: E402
from tiny_runs import (accelerate_env, assert_same_update, free_port, records, run_launch,  # noqa: E402
                       write_sd3_config)

from jagg.cli import main  # noqa: E402
from jagg.infra.engine import EngineSettings, resolve_engine  # noqa: E402
from jagg.infra.launch import HANDLED, LaunchSettings, read_launch  # noqa: E402
from jagg.trainers.diffusers_trainer import engine_for  # noqa: E402
from jagg.infra.shards import read_whole  # noqa: E402
from jagg.trainers.diffusers_config import load_config  # noqa: E402
from jagg.trainers.trained_run import load_trained  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = str(Path(__file__).parent / "real_train_launch.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(Path(__file__).parent),
                                                                         os.environ.get("PYTHONPATH", "")]))


def _args(cfg: Path, sets: list[str]) -> list[str]:
    return ["train", "--config", str(cfg)] + [a for s in sets for a in ("--set", s)]


def _launch(prefix: list[str], args: list[str]) -> None:
    proc = run_launch([sys.executable, "-m", *prefix, LAUNCHER, *args], env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _accelerate(config: str, *extra: str) -> list[str]:
    return ["accelerate.commands.launch", "--config_file", str(ROOT / "configs" / "accelerate" / config),
            "--num_processes", "2", "--main_process_port", str(free_port()), *extra]


TORCHRUN = ["torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _ranks(out: Path) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt") for r in (0, 1)]


def _half(local: list[int], full: int) -> None:
    """Two ranks each store about half of ``full`` elements, and together all of them."""
    assert sum(local) == full and all(0.4 < n / full < 0.6 for n in local), (local, full)


def _from_checkpoint_1(src: Path, dst: Path) -> None:
    """``dst``: the run ``src`` as it was after its first iteration (its second checkpoint, export and ranks gone)."""
    shutil.copytree(src, dst)
    for p in [*dst.glob("checkpoints/ckpt_000002*"), dst / "final", *dst.glob("rank*.pt")]:
        shutil.rmtree(p) if p.is_dir() else p.unlink()


FULL_FT = ["pipeline.lora.enabled=false", "pipeline.keep_reference=true", "estimator.kl_beta=0.1",
           "grpo.updates_per_epoch=1", "grpo.drop_zero_spread=true", "sample.micro_batch=2", "log.sample_images=0",
           "reward.name=reward_plugins:red_is_dark", "optim.lr=0.001"]


def test_fsdp_full_finetune_shards_equals_one_process_and_resumes(tmp_path, sd3_dir):
    """`accelerate launch --config_file configs/accelerate/fsdp.yaml` of `jagg train` (SD3, full fine-tuning, KL to
    the sharded frozen reference, fsdp_activation_checkpointing): per-rank halves, the one-process result, and two
    resumes from its first checkpoint."""
    cfg = write_sd3_config(tmp_path, sd3_dir)
    (tmp_path / "two.txt").write_text("a red cube\na blue ball\n")
    sets = FULL_FT + [f"sample.prompts_file={tmp_path / 'two.txt'}", "optim.ema_decay=0.5"]
    fsdp, one = tmp_path / "fsdp", tmp_path / "one"
    _launch(_accelerate("fsdp.yaml", "--mixed_precision", "no", "--fsdp_activation_checkpointing", "true"),
            _args(cfg, sets) + ["--output-dir", str(fsdp)])
    ranks = _ranks(fsdp)
    assert [r["engine"] for r in ranks] == ["fsdp", "fsdp"]
    for what in ("param", "adam", "reference"):
        _half([r[f"{what}_local"] for r in ranks], ranks[0][f"{what}_full"])
    assert ranks[0]["param_full"] == sum(p.numel() for p in SD3Transformer2DModel.from_pretrained(
        sd3_dir / "transformer").parameters())                     # every weight trains
    assert ranks[0]["adam_full"] == 2 * ranks[0]["param_full"]                    # FSDP: a gradient for every weight
    # the red cube's group has zero spread and is dropped: its rank trains nothing and fills in the others' calls
    two = records(fsdp)
    assert [r["trained_samples"] for r in two] == [2, 2] and sum(r["fillers"] for r in ranks) > 0
    ck = sorted(p.name for p in (fsdp / "checkpoints").iterdir())
    assert ck == ["ckpt_000001.dcp", "ckpt_000001.pt", "ckpt_000002.dcp", "ckpt_000002.pt", "transformer_000001",
                  "transformer_000002"]                       # each checkpoint's export, gathered from the shards
    saved = torch.load(fsdp / "checkpoints" / "ckpt_000002.pt", weights_only=False)
    assert saved["model"] == "ckpt_000002.dcp"
    assert saved["engine"] == {"strategy": "fsdp", "processes": 2, "param_dtype": None}
    assert saved["config"]["pipeline"]["gradient_checkpointing"] is True        # the accelerate key, honoured

    # one process on the same global batches: the same metrics and, after 2 AdamW steps, the same weights
    assert main(_args(cfg, sets + ["pipeline.gradient_checkpointing=true"]) + ["--output-dir", str(one)]) == 0
    for a, b in zip(records(one), two):
        assert_same_update(b, a)
    got, want = (SD3Transformer2DModel.from_pretrained(d / "final" / "transformer").state_dict() for d in (fsdp, one))
    start = SD3Transformer2DModel.from_pretrained(sd3_dir / "transformer").state_dict()
    assert max(float((want[k] - start[k]).abs().max()) for k in want) > 1e-3            # 2 steps of lr 1e-3
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=2e-5, msg=k)
    assert all(torch.equal(ranks[0]["weights"][n], got[n]) for n in ranks[0]["weights"])
    last = SD3Transformer2DModel.from_pretrained(fsdp / "checkpoints" / "transformer_000002").state_dict()
    assert all(torch.equal(last[k], got[k]) for k in got)           # the last checkpoint's export is the final one
    # the EMA of the sharded weights, sharded itself, gathered into the export: the one-process EMA's
    ema, ema_one = (SD3Transformer2DModel.from_pretrained(d / "final" / "transformer" / "ema").state_dict()
                    for d in (fsdp, one))
    assert max(float((ema_one[k] - want[k]).abs().max()) for k in want) > 1e-4      # an average, not the weights
    for k in ema_one:
        torch.testing.assert_close(ema[k], ema_one[k], rtol=0, atol=2e-5, msg=k)
    # jagg eval / jagg sample read the shards whole on one process: the EMA's weights, or (--raw-weights) the trained
    for raw, want_weights in ((False, ema), (True, got)):
        run = load_trained(fsdp / "checkpoints" / "ckpt_000002.pt", _eval_args(raw))
        assert run.weights == ("trained" if raw else "EMA")
        assert all(torch.equal(p.detach(), want_weights[n]) for n, p in run.policy.named_params.items())

    # resume from the first checkpoint with torchrun: bit-identical to the uninterrupted run (keeping 1 checkpoint:
    # the first one's shards go with it)
    again = tmp_path / "again"
    _from_checkpoint_1(fsdp, again)
    resume = sets + ["distributed.strategy=fsdp", "pipeline.gradient_checkpointing=true"]
    _launch(TORCHRUN, _args(cfg, resume + ["log.keep_last=1"]) + ["--output-dir", str(again), "--resume"])
    assert sorted(p.name for p in (again / "checkpoints").iterdir()) == ["ckpt_000002.dcp", "ckpt_000002.pt",
                                                                       "transformer_000002"]
    final = SD3Transformer2DModel.from_pretrained(again / "final" / "transformer").state_dict()
    assert all(torch.equal(final[k], got[k]) for k in got)
    final_ema = SD3Transformer2DModel.from_pretrained(again / "final" / "transformer" / "ema").state_dict()
    assert all(torch.equal(final_ema[k], ema[k]) for k in ema)       # the EMA's shards resumed bit-identically
    assert [(r["loss"], r["grad_norm"]) for r in records(again)] == [(r["loss"], r["grad_norm"]) for r in two]
    # ... and with one process: the shards read into whole weights (resharded), the same run to float precision
    single = tmp_path / "single"
    _from_checkpoint_1(fsdp, single)
    assert main(_args(cfg, resume) + ["--output-dir", str(single), "--resume"]) == 0
    final = SD3Transformer2DModel.from_pretrained(single / "final" / "transformer").state_dict()
    for k in got:
        torch.testing.assert_close(final[k], got[k], rtol=0, atol=2e-5, msg=k)


def _eval_args(raw: bool = False):
    """The options of `jagg eval` / `jagg sample` that load_trained reads."""
    import argparse

    return argparse.Namespace(raw_weights=raw, guidance_scale=None, shift=None)


def test_fsdp_lora_on_flux_equals_one_process(tmp_path):
    """FLUX with LoRA under FSDP2 (torchrun, distributed.strategy: fsdp, the KL term to the adapters switched off):
    each rank stores half of the adapters, the update is one process's, and the gathered adapter is exported once."""
    pipe = diffusers.FluxPipeline(transformer=tiny_flux(), scheduler=FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True), vae=tiny_vae(), text_encoder=None, tokenizer=None, text_encoder_2=None,
        tokenizer_2=None)
    pipe.save_pretrained(tmp_path / "flux")
    cond, _ = embeds(prompts=("a red cube", "a blue ball"))
    cond.select([0, 2]).save(tmp_path / "cache.pt")
    (tmp_path / "prompts.txt").write_text("a red cube\na blue ball\n")
    (tmp_path / "flux.yaml").write_text(f"""\
pipeline: {{family: flux, path: {tmp_path / "flux"}, dtype: fp32, device: cpu, resolution: 128, num_steps: 4,
           cfg_scale: 1.0, guidance_embed: 3.5, eta: 0.9, prompt_cache: {tmp_path / "cache.pt"}, lora: {{rank: 2}}}}
reward: {{name: jpeg_compressibility}}
sample: {{prompts_file: {tmp_path / "prompts.txt"}, prompts_per_iter: 2, group_size: 2, micro_batch: 2}}
estimator: {{mode: jagg, window: 4, micro_batch: 4, clip_range: 0.2, kl_beta: 0.1, correction_p: 0.0}}
optim: {{lr: 0.001}}
grpo: {{iterations: 1, updates_per_epoch: 1, drop_zero_spread: false}}
log: {{tensorboard: false, progress: false, sample_images: 0}}
distributed: {{strategy: fsdp}}
threads: 1
""")
    args = ["train", "--config", str(tmp_path / "flux.yaml")]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(args + ["--output-dir", str(one)]) == 0
    _launch(TORCHRUN, args + ["--output-dir", str(two)])
    ranks = _ranks(two)
    assert [r["engine"] for r in ranks] == ["fsdp", "fsdp"]
    _half([r["param_local"] for r in ranks], ranks[0]["param_full"])
    _half([r["adam_local"] for r in ranks], ranks[0]["adam_full"])
    (a,), (b,) = records(one), records(two)
    assert_same_update(b, a)
    from safetensors.torch import load_file

    got, want = (load_file(d / "final" / "adapter" / "pytorch_lora_weights.safetensors") for d in (two, one))
    weights = ranks[0]["weights"]
    assert set(got) == set(want) == {"transformer." + n.replace(".default", "") for n in weights}
    for name, w in weights.items():
        key = "transformer." + name.replace(".default", "")
        assert torch.equal(got[key], w), name                          # the export is the gathered weights
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-5, msg=name)
    assert max(float(w.abs().max()) for n, w in weights.items() if "lora_B" in n) > 5e-4   # lora_B left 0


def test_the_shipped_accelerate_configs_are_honoured(tmp_path, sd3_dir):
    """Every variable accelerate sets for a process is one jagg reads; ddp.yaml's bf16 is the autocast of a DDP run,
    fsdp.yaml's the MixedPrecisionPolicy of an FSDP run; the DeepSpeed config is refused naming its key."""
    cfg = write_sd3_config(tmp_path, sd3_dir)
    for name in ("ddp", "fsdp"):
        env = accelerate_env(ROOT / "configs" / "accelerate" / f"{name}.yaml")
        assert set(env) <= set(HANDLED), set(env) - set(HANDLED)
        launch = read_launch(env)
        c = load_config(cfg)
        settings = resolve_engine(c, launch, 8)
        if name == "ddp":
            assert (launch.strategy, settings.strategy, c.pipeline.autocast) == ("ddp", "ddp", "bf16")
        else:
            assert (settings.strategy, settings.param_dtype, settings.wrap, settings.wrap_classes) == \
                ("fsdp", "bf16", "blocks", None)
            assert c.pipeline.autocast is None and settings.reshard_after_forward is True
    env = accelerate_env(ROOT / "configs" / "accelerate" / "fsdp.yaml", "--fsdp_reshard_after_forward", "false",
                         "--fsdp_activation_checkpointing", "true")
    c = load_config(cfg)
    assert resolve_engine(c, read_launch(env), 2).reshard_after_forward is False and c.pipeline.gradient_checkpointing
    with pytest.raises(ValueError, match="distributed_type: DEEPSPEED is not supported by jagg train"):
        read_launch({"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_DEEPSPEED": "true"})
    assert (ROOT / "configs" / "accelerate" / "deepspeed_zero2.yaml").read_text().startswith(
        "# Not for `jagg train`")


FSDP_ENV = {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
            "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"}


@pytest.mark.parametrize("change, key", [
    ({"FSDP_OFFLOAD_PARAMS": "true"}, "fsdp_offload_params: true"),
    ({"FSDP_VERSION": "1"}, "fsdp_version: 1"),
    ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"}, "fsdp_auto_wrap_policy: SIZE_BASED_WRAP"),
    ({"FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"}, "fsdp_state_dict_type: FULL_STATE_DICT"),
    ({"FSDP_SHARDING_STRATEGY": "HYBRID_SHARD"}, "fsdp_sharding_strategy: HYBRID_SHARD"),
    ({"FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE"}, "fsdp_backward_prefetch: BACKWARD_PRE"),
    ({"FSDP_IGNORED_MODULES": "pos_embed"}, "fsdp_ignored_modules"),
    ({"ACCELERATE_MIXED_PRECISION": "fp16"}, "mixed_precision: fp16"),
    ({"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}, "dynamo_backend: INDUCTOR"),
    ({"ACCELERATE_USE_MEGATRON_LM": "true"}, "distributed_type: MEGATRON_LM"),
])
def test_an_unsupported_accelerate_setting_is_refused_by_name(change, key):
    with pytest.raises(ValueError, match=f"the accelerate config's {key} is not supported by jagg train: "):
        read_launch({**FSDP_ENV, **change})


def test_the_config_and_the_launcher_must_agree(tmp_path, sd3_dir):
    """A key set both in the jagg config and the accelerate config must agree; torchrun takes the config's; one
    process runs no engine; FSDP refuses the main-process audit before anything loads, not estimator.mode: auto."""
    cfg = write_sd3_config(tmp_path, sd3_dir)
    fsdp = read_launch(FSDP_ENV)
    assert fsdp == LaunchSettings(launcher="accelerate", strategy="fsdp", wrap="blocks", reshard_after_forward=True)
    cases = [(["distributed.strategy=ddp"], fsdp, "distributed.strategy is 'ddp' but the accelerate config's "
              "distributed_type is 'fsdp'"),
             (["distributed.wrap_classes=[FluxTransformerBlock]"],
              read_launch({**FSDP_ENV, "FSDP_TRANSFORMER_CLS_TO_WRAP": "JointTransformerBlock"}),
              "fsdp_transformer_layer_cls_to_wrap"),
             (["pipeline.autocast=fp16"], read_launch({"ACCELERATE_MIXED_PRECISION": "bf16"}),
              "pipeline.autocast is 'fp16' but the accelerate config's mixed_precision is 'bf16'"),
             (["pipeline.lora.fp32_params=false"], read_launch({"ACCELERATE_MIXED_PRECISION": "bf16"}),
              "pipeline.lora.fp32_params: true")]
    for sets, launch, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
            resolve_engine(load_config(cfg, sets), launch, 2)
    torchrun = LaunchSettings()
    assert resolve_engine(load_config(cfg, ["distributed.strategy=fsdp"]), torchrun, 2).strategy == "fsdp"
    assert resolve_engine(load_config(cfg), torchrun, 2) == EngineSettings("ddp")
    assert resolve_engine(load_config(cfg, ["distributed.strategy=fsdp"]), torchrun, 1).strategy == "single"
    with pytest.raises(ValueError, match="distributed.strategy must be one of"):
        load_config(cfg, ["distributed.strategy=zero3"])
    with pytest.raises(ValueError, match="estimator.meter_every > 0 audits"):
        engine_for(load_config(cfg, ["estimator.meter_every=1"]), fsdp, 2)
    assert engine_for(load_config(cfg, ["estimator.meter_every=1"]), fsdp, 1).strategy == "single"
    for sets in (["estimator.mode=auto"], ["estimator.mode=auto", "estimator.meter_every=5"]):   # auto's re-check
        assert engine_for(load_config(cfg, sets), fsdp, 2).strategy == "fsdp"
    assert engine_for(load_config(cfg, ["estimator.mode=auto"]), torchrun, 2).strategy == "ddp"


def test_fsdp_engine_in_bf16_mixed_precision_on_one_sharded_process(tmp_path):
    """The FSDP engine on a process group of one (gloo): a full fine-tune of a bf16 SD3 becomes fp32 master shards
    that compute in bf16 (accelerate's mixed_precision bf16: MixedPrecisionPolicy) with fp32 gradients, its frozen
    reference stays bf16 and is in step too; block classes that name no module are refused by their key; the
    gathered weights export as the plain diffusers class."""
    import torch.distributed as dist

    from tiny_pipelines import tiny_sd3

    from jagg.infra.engine import make_engine
    from jagg.integrations import PipelineConfig, save_transformer
    from jagg.integrations.policy import Policy

    config = PipelineConfig(family="sd3", dtype="bf16", device="cpu", resolution=128, keep_reference=True,
                            lora={"enabled": False})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"fsdp_transformer_layer_cls_to_wrap: \['FluxTransformerBlock'\] name no "
                                             r"module of SD3Transformer2DModel; its transformer blocks are "
                                             r"\['JointTransformerBlock'\]"):
            make_engine(EngineSettings("fsdp", wrap_classes=("FluxTransformerBlock",),
                                       wrap_key="fsdp_transformer_layer_cls_to_wrap"), 0, 1, torch.device("cpu")) \
                .wrap(Policy(config, tiny_sd3().to(torch.bfloat16), place=False))
        policy = Policy(config, tiny_sd3().to(torch.bfloat16), place=False)
        assert {p.dtype for p in policy.params} == {torch.bfloat16}           # the upcast waits for the shards
        engine = make_engine(EngineSettings("fsdp", param_dtype="bf16"), 0, 1, torch.device("cpu"))
        engine.wrap(policy)
        assert {type(p).__name__ for p in policy.params} == {"DTensor"} and {p.dtype for p in policy.params} == \
            {torch.float32}
        assert {p.dtype for p in policy.reference_model.parameters()} == {torch.bfloat16}
        assert len(engine.lockstep.modules) == 2
        seen = []
        policy.bare.transformer_blocks[0].attn.to_q.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        x, t = torch.randn(2, 4, 16, 16), torch.tensor([500.0, 300.0])
        enc, pooled = torch.randn(2, 5, 16), torch.randn(2, 8)
        with engine.update():
            out = policy.transformer(hidden_states=x, encoder_hidden_states=enc, pooled_projections=pooled,
                                     timestep=t, return_dict=False)[0]
            out.float().square().mean().backward()
        assert seen == [torch.bfloat16] and {p.grad.dtype for p in policy.params} == {torch.float32}
        weights = engine.full_state_dict(policy.bare)
        save_transformer(policy.bare, tmp_path / "transformer", weights)
        back = SD3Transformer2DModel.from_pretrained(tmp_path / "transformer").state_dict()
        assert set(back) == set(weights) and all(torch.equal(back[k], weights[k]) for k in back)
        assert {v.dtype for v in back.values()} == {torch.float32}
    finally:
        dist.destroy_process_group()


def _at_checkpoint(src: Path, dst: Path, n: int) -> None:
    """``dst``: the run ``src`` as it was after iteration ``n`` (its later checkpoints, exports and ranks gone)."""
    shutil.copytree(src, dst)
    later = [p for p in (dst / "checkpoints").iterdir() if int(p.name.split("_")[1].split(".")[0]) > n]
    for p in [*later, dst / "final", *dst.glob("rank*.pt")]:
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def test_fsdp_lora_resumes_resharded_two_one_two(tmp_path, sd3_dir):
    """FSDP with LoRA (the shards hold the adapters only) on 2 processes, resumed from its first checkpoint on 1
    process (the shards read into whole weights, which it saves), then from that one's checkpoint on 2 processes under
    FSDP again (the whole weights sharded): the same run as the uninterrupted one, within float precision."""
    from safetensors.torch import load_file

    cfg = write_sd3_config(tmp_path, sd3_dir)
    sets = ["distributed.strategy=fsdp", "grpo.updates_per_epoch=1", "sample.micro_batch=2", "log.sample_images=0",
            "optim.ema_decay=0.5", "log.keep_last=3"]
    whole = tmp_path / "whole"
    _launch(TORCHRUN, _args(cfg, sets + ["grpo.iterations=3"]) + ["--output-dir", str(whole)])
    assert torch.load(whole / "checkpoints" / "ckpt_000001.pt", weights_only=False)["model"] == "ckpt_000001.dcp"
    run = tmp_path / "run"
    _at_checkpoint(whole, run, 1)
    assert main(_args(cfg, sets + ["grpo.iterations=2"]) + ["--output-dir", str(run), "--resume"]) == 0
    assert isinstance(torch.load(run / "checkpoints" / "ckpt_000002.pt", weights_only=False)["model"], dict)
    _launch(TORCHRUN, _args(cfg, sets + ["grpo.iterations=3"]) + ["--output-dir", str(run), "--resume"])
    assert torch.load(run / "checkpoints" / "ckpt_000003.pt", weights_only=False)["engine"]["processes"] == 2
    want, got = records(whole), records(run)
    assert [r["iteration"] for r in got] == [1, 2, 3]
    for a, b in zip(got, want):
        assert_same_update(a, b)
    for sub in ("", "ema/"):
        a, b = (load_file(d / "final" / "adapter" / sub / "pytorch_lora_weights.safetensors") for d in (run, whole))
        assert set(a) == set(b)
        for k in b:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5, msg=k)
    # jagg eval / jagg sample of the sharded run: its EMA (read whole from the shards: the adapters they load)
    ema = read_whole(whole / "checkpoints" / "ckpt_000003.dcp", "ema", load_trained(
        whole / "checkpoints" / "ckpt_000003.pt", _eval_args(True)).policy.named_params)
    trained = load_trained(whole / "checkpoints" / "ckpt_000003.pt", _eval_args())
    assert trained.weights == "EMA" and set(ema) == set(trained.policy.named_params)
    for n, p in trained.policy.named_params.items():
        torch.testing.assert_close(p.detach(), ema[n], rtol=0, atol=1e-7, msg=n)


def test_auto_on_two_processes_measures_the_whole_gradient_as_one_process(tmp_path, sd3_dir):
    """estimator.mode: auto on 2 processes, DDP and FSDP2 (LoRA): each measured gradient is the whole one on every
    process (FSDP's shards gathered), and a process without a sample in an update (each update here is one prompt
    group, on one process) measures beside the other, so the measurement and its records are one process's (the error,
    the noise and the signal within float precision), the decision is the same (exact, at a margin of 100) and so is
    every update."""
    cfg = write_sd3_config(tmp_path, sd3_dir)
    sets = ["grpo.iterations=6", "estimator.mode=auto", "estimator.preflight_batches=3", "estimator.preflight_share=1",
            "estimator.candidates=[\"g3:window=3\"]", "estimator.preflight_margin=100", "grpo.minibatches=groups",
            "sample.micro_batch=2", "log.sample_images=0"]
    one = tmp_path / "one"
    assert main(_args(cfg, sets) + ["--output-dir", str(one)]) == 0
    a = json.loads((one / "preflight.json").read_text())
    assert a["train_with"] == "exact" and a["measured_iterations"] == 3
    assert {r["estimator"] for r in a["records"]} == {"exact", "g3"}
    assert next(r for r in a["records"] if r["estimator"] == "g3")["error_to_noise"] > 1e-3   # a real error
    ta = [r for r in records(one) if r["kind"] == "train"]
    for strategy in ("ddp", "fsdp"):
        two = tmp_path / strategy
        _launch(TORCHRUN, _args(cfg, sets + [f"distributed.strategy={strategy}"]) + ["--output-dir", str(two)])
        assert [r["engine"] for r in _ranks(two)] == [strategy, strategy]
        b = json.loads((two / "preflight.json").read_text())
        assert b["train_with"] == "exact" and b["measured_iterations"] == 3, strategy
        assert [(r["estimator"], r["update"]) for r in b["records"]] == [(r["estimator"], r["update"])
                                                                          for r in a["records"]]
        for got, want in zip(b["records"], a["records"]):
            for k in ("error_to_noise", "bias_to_noise", "signal_to_noise", "rows_per_sample"):
                assert got[k] == pytest.approx(want[k], rel=1e-3, abs=1e-6), (strategy, got["estimator"], k)
        tb = [r for r in records(two) if r["kind"] == "train"]
        assert len(ta) == len(tb) == 6
        for got, want in zip(tb, ta):
            assert_same_update(got, want)


def test_ctrl_c_under_torchrun_saves_once_on_every_rank_and_says_so_last(tmp_path, sd3_dir):
    """Ctrl-C (SIGINT to the launcher and its processes, as a terminal sends it) under torchrun with 2 FSDP processes:
    the first screen names the engine and what rank 0 holds; every rank finishes the iteration and writes its shards
    once; what the user sees last, after torchrun's own report of the signal, is the checkpoint and how to resume."""
    import signal
    import time

    cfg = write_sd3_config(tmp_path, sd3_dir)
    out = tmp_path / "run"
    args = _args(cfg, ["distributed.strategy=fsdp", "grpo.iterations=1000", "log.checkpoint_every=0",
                       "log.sample_images=0"]) + ["--output-dir", str(out)]
    with open(tmp_path / "stdout", "w") as so, open(tmp_path / "stderr", "w") as se:
        proc = subprocess.Popen([sys.executable, "-m", *TORCHRUN, LAUNCHER, *args], env=ENV, stdout=so, stderr=se,
                                start_new_session=True)
        try:
            while proc.poll() is None and not (out / "metrics.jsonl").is_file():   # an iteration done: the loop runs
                time.sleep(0.2)
            assert proc.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    for _ in range(100):                           # the line said after torchrun's exit comes from a detached process
        if "jagg: stopped by a signal" in stderr:
            break
        time.sleep(0.1)
        stderr = (tmp_path / "stderr").read_text()
    assert "engine     FSDP2 (sharded) on 2 processes; rank 0 holds" in stdout
    assert stdout.count("received signal 2: finishing this iteration") == 1
    (pt,) = (out / "checkpoints").glob("ckpt_*.pt")
    assert sorted(p.name for p in (out / "checkpoints" / pt.name.replace(".pt", ".dcp")).glob("*.distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]                            # both ranks saved their shards, once
    assert {r["iteration"] for r in records(out)} == set(range(1, int(pt.stem.split("_")[1]) + 1))
    last = stderr.strip().splitlines()[-1]
    assert last == (f"jagg: stopped by a signal after iteration {int(pt.stem.split('_')[1])}, every process saved: "
                    f"{pt}; continue with --resume (the same launch command)"), stderr[-3000:]


def test_a_refusal_under_torchrun_is_the_last_line(tmp_path, sd3_dir):
    """A refusal before the model loads (the estimator audit under FSDP) under torchrun: every process exits 2 with
    the one line, and after torchrun's own report of the failed processes the line comes again, last."""
    cfg = write_sd3_config(tmp_path, sd3_dir)
    proc = subprocess.run([sys.executable, "-m", *TORCHRUN, LAUNCHER, *_args(cfg, [
        "distributed.strategy=fsdp", "estimator.meter_every=1"]), "--output-dir", str(tmp_path / "run")], env=ENV,
        capture_output=True, text=True, timeout=300)         # returns once the detached process said the line
    line = "jagg train: error: estimator.meter_every > 0 audits the estimator on the main process's whole gradient"
    assert proc.returncode == 1 and "ChildFailedError" in proc.stderr          # torchrun's own status and report
    assert proc.stderr.count(line) == 3 and proc.stderr.strip().splitlines()[-1].startswith(line), proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()
