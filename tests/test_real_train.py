"""``jagg train --config <yaml with pipeline:>`` end to end on tiny random diffusers models saved to disk.

SD3 with LoRA: metrics, diffusers-loadable adapters, only the adapters train, ``--resume`` continues exactly as an
uninterrupted run. FLUX with full fine-tuning, the KL reference and an HTTP reward server. Qwen-Image with LoRA, its
text encoder, true CFG, DanceGRPO's SDE and index-interpolated step groups (the JAGG authors' recipe, scaled down).
Clear errors for bad model paths, prompt files, prompt caches and rewards; SIGTERM saves and exits; non-finite
updates are skipped, then the run aborts. Two CPU processes launched by accelerate keep identical replicas and make
the one-process update. A run on a .jsonl prompt set rewarded by Flow-GRPO's GenEval server, OCR and VLM judge
(stand-ins on loopback).
"""

from __future__ import annotations

import json
import os
import pickle
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import diffusers  # noqa: E402
import reward_plugins  # noqa: E402
from flow_grpo_standins import geneval_answer, judge_server, serving  # noqa: E402
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel  # noqa: E402
from tiny_pipelines import embeds, tiny_flux, tiny_vae  # noqa: E402
from tiny_runs import SD3_PROMPTS, assert_same_update, free_port, records, run_launch, write_sd3_config  # noqa: E402

from jagg.cli import main  # noqa: E402
from jagg.integrations import VelocityConfig, velocity_adapter  # noqa: E402
from jagg.trainers import diffusers_trainer as real_train, diffusers_config as train_config  # noqa: E402


@pytest.fixture
def captured(monkeypatch):
    """Every DiffusersTrainer that `jagg train` runs, with copies of its trainable weights when training starts."""
    seen = []
    original = real_train.DiffusersTrainer.train

    def train(self):
        seen.append((self, lora_weights(self), [int(self.opt.state[p]["step"]) for p in self.params
                                                 if p in self.opt.state]))
        return original(self)

    monkeypatch.setattr(real_train.DiffusersTrainer, "train", train)
    return seen


def lora_weights(trainer) -> dict:
    return {n: p.detach().clone() for n, p in trainer.named_params.items()}


def test_sd3_lora_train_adapters_and_resume(tmp_path, sd3_dir, captured):
    cfg = write_sd3_config(tmp_path, sd3_dir)
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--output-dir", str(out)]) == 0
    rec = records(out)
    assert [r["iteration"] for r in rec] == [1, 2] and all(r["kind"] == "train" for r in rec)
    for r in rec:
        assert np.isfinite(r["reward_mean"]) and np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"])
        assert r["samples"] == 4 and r["trained_samples"] == 4 and r["updates"] == 2 and r["skipped"] == 0
        # 4 samples x 4 trained steps in groups [0,1,2] (JAGG: 2 endpoint rows) + [3] (exact: 1 row)
        assert r["backward_items"] == 4 * 3 and r["jagg_frac_routed"] == 1.0
    assert rec[1]["kl"] > 0                                  # the policy moved away from the reference
    ck = out / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["adapter_000001", "adapter_000002", "ckpt_000001.pt",
                                                    "ckpt_000002.pt"]
    assert (out / "samples" / "iter_000002.png").is_file() and (out / "reward_curve.png").is_file()

    trainer, start, _ = captured[0]
    assert trainer.params and all("lora_" in n for n in trainer.named_params)
    end = lora_weights(trainer)
    changed = {n for n in end if not torch.equal(start[n], end[n])}
    # the adapters trained: every lora_B but those with an exactly zero gradient (the last SD3 block's context query
    # only feeds context outputs that the last block discards)
    assert changed >= {n for n, p in trainer.named_params.items() if "lora_B" in n and p.grad is not None
                       and p.grad.abs().max() > 0}
    assert len(changed) > 0.9 * len(end)
    fresh = SD3Transformer2DModel.from_pretrained(sd3_dir / "transformer")
    base = dict(fresh.named_parameters())
    trained_base = {n.replace(".base_layer", ""): p for n, p in trainer.policy.transformer.named_parameters()
                    if "lora_" not in n}
    assert set(trained_base) == set(base)
    assert all(torch.equal(trained_base[n], base[n]) for n in base)                      # the base did not

    # the adapter directory loads into a fresh pipeline with diffusers' own loader and gives the trained policy
    pipe = diffusers.StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel.from_pretrained(sd3_dir / "transformer"), scheduler=None, vae=None,
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None, tokenizer_3=None)
    pipe.load_lora_weights(str(ck / "adapter_000002"))
    cond = trainer.policy.embeddings(SD3_PROMPTS[:2])
    neg = trainer.policy.negative()
    x, s, i = torch.randn(2, 4, 16, 16), torch.tensor([0.9, 0.4]), torch.tensor([0, 1])
    with torch.no_grad():
        want = trainer.policy.velocity(cond)(x, s, i)
        got = velocity_adapter(pipe.transformer, cond, neg, VelocityConfig(cfg_scale=4.5))(x, s, i)
        base_v = velocity_adapter(fresh, cond, neg, VelocityConfig(cfg_scale=4.5))(x, s, i)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (want - base_v).abs().max() > 1e-6

    # --resume: one more iteration from iteration 2, weights and optimizer restored ...
    assert main(["train", "--config", str(cfg), "--output-dir", str(out), "--resume",
                 "--set", "grpo.iterations=3"]) == 0
    resumed, resumed_start, steps = captured[1]
    assert all(torch.equal(resumed_start[n], end[n]) for n in end)
    assert len(steps) == len(end) and set(steps) == {4}          # 2 iterations x 2 AdamW updates
    assert [r["iteration"] for r in records(out)] == [1, 2, 3]
    assert sorted(p.name for p in ck.iterdir()) == ["adapter_000002", "adapter_000003", "ckpt_000002.pt",
                                                    "ckpt_000003.pt"]            # keep_last = 2
    # ... exactly as a run that was never interrupted
    straight = tmp_path / "straight"
    assert main(["train", "--config", str(cfg), "--output-dir", str(straight), "--set", "grpo.iterations=3"]) == 0
    a, b = lora_weights(resumed), lora_weights(captured[2][0])
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert [r["reward_mean"] for r in records(out)] == [r["reward_mean"] for r in records(straight)]
    # a changed key that breaks continuation is refused, naming it
    assert main(["train", "--config", str(cfg), "--output-dir", str(out), "--resume",
                 "--set", "grpo.iterations=4", "--set", "optim.lr=0.5"]) == 2


def test_bad_model_paths_and_config_errors(tmp_path, sd3_dir, capsys):
    cfg = write_sd3_config(tmp_path, tmp_path / "no_such_model")
    assert main(["train", "--config", str(cfg), "--output-dir", str(tmp_path / "r")]) == 2
    assert "does not exist; jagg never downloads weights" in capsys.readouterr().err
    (tmp_path / "not_diffusers").mkdir()
    cfg = write_sd3_config(tmp_path, tmp_path / "not_diffusers")
    assert main(["train", "--config", str(cfg)]) == 2
    assert "is not a diffusers model directory: no model_index.json" in capsys.readouterr().err
    cfg = write_sd3_config(tmp_path, tmp_path / "prompts.txt")
    assert main(["train", "--config", str(cfg)]) == 2
    assert "is a file; it must be a diffusers model directory" in capsys.readouterr().err

    cfg = write_sd3_config(tmp_path, sd3_dir)
    cases = [(["sample.prompts_file=null"], "sample.prompts_file must be set"),
             ([f"sample.prompts_file={tmp_path / 'missing.txt'}"], "missing.txt' does not exist"),
             (["reward=null"], "set exactly one of reward"),
             (["reward_server.url=http://127.0.0.1:1"], "both are set"),
             (["sample.sde_window=[2, 9]"], "pipeline.num_steps=4"),
             (["pipeline.lora.enabled=false"], "keep_reference"),
             (["pipeline.cfg_scal=2"], "did you mean 'cfg_scale'"),
             (["reward.name=pickscore:pth=/models/x"], "reward.name: reward 'pickscore': unknown option(s) ['pth']")]
    for sets, message in cases:
        args = ["train", "--config", str(cfg)] + [a for s in sets for a in ("--set", s)]
        assert main(args) == 2, sets
        assert message in capsys.readouterr().err, sets
    (tmp_path / "empty.txt").write_text("\n  \n")
    assert main(["train", "--config", str(cfg), "--set", f"sample.prompts_file={tmp_path / 'empty.txt'}"]) == 2
    assert "holds no prompt" in capsys.readouterr().err


def test_shipped_configs_reach_the_model_check(tmp_path, capsys):
    """configs/sd35_medium.yaml, flux_dev.yaml and qwen_image.yaml load as real-model configs; with a prompts file the
    placeholder model path (qwen_image: first its reward's, HPSv2) fails with the download hint (no weights here)."""
    (tmp_path / "p.txt").write_text("a photo of a cat\n")
    root = Path(__file__).resolve().parents[1]
    for name in ("sd35_medium", "flux_dev", "qwen_image"):
        path = root / "configs" / f"{name}.yaml"
        assert train_config.has_pipeline_section(path)
        assert main(["train", "--config", str(path), "--output-dir", str(tmp_path / name)]) == 2
        assert "sample.prompts_file must be set" in capsys.readouterr().err
        cfg = train_config.load_config(path, [f"sample.prompts_file={tmp_path / 'p.txt'}"])
        assert (cfg.reward_server is None) == (name == "qwen_image") and (cfg.reward is None) != (name == "qwen_image")
        if not Path(cfg.pipeline.path).exists():
            assert main(["train", "--config", str(path), "--output-dir", str(tmp_path / name),
                         "--set", f"sample.prompts_file={tmp_path / 'p.txt'}"]) == 2
            assert "never downloads weights" in capsys.readouterr().err


def test_sigterm_finishes_the_iteration_and_saves(tmp_path, sd3_dir, capsys, monkeypatch):
    cfg = write_sd3_config(tmp_path, sd3_dir)
    out = tmp_path / "run"
    monkeypatch.setattr(reward_plugins, "CALLS", 0)
    monkeypatch.setattr(reward_plugins, "SIGTERM_AT", 1)                 # SIGTERM during the first iteration
    assert main(["train", "--config", str(cfg), "--output-dir", str(out), "--set", "grpo.iterations=5",
                 "--set", "log.checkpoint_every=0", "--set", "reward.name=reward_plugins:sigterm_at"]) == 0
    assert "continue with --resume" in capsys.readouterr().out
    assert [r["iteration"] for r in records(out)] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["adapter_000001", "ckpt_000001.pt"]


def test_non_finite_updates_are_skipped_then_the_run_aborts(tmp_path, sd3_dir, capsys):
    """lr = 1e30 blows the adapters up after the first update: later updates have a NaN loss and are skipped (weights
    untouched), and after grpo.max_consecutive_skips in a row the run saves and aborts with a message."""
    cfg = write_sd3_config(tmp_path, sd3_dir)
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--output-dir", str(out), "--set", "optim.lr=1e30",
                 "--set", "optim.weight_decay=0", "--set", "optim.max_grad_norm=0", "--set", "grpo.iterations=5", "--set", "grpo.max_consecutive_skips=2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]          # after diffusers' loading bars
    assert err.startswith("jagg train: aborted: 2 consecutive updates had a non-finite loss")
    rec = records(out)
    assert [(r["iteration"], r["skipped"], r["skipped_total"]) for r in rec] == [(1, 1, 1), (2, 2, 3)]
    assert (out / "checkpoints" / "ckpt_000002.pt").is_file()


def _serve(reward_fn):
    from jagg.rewards.server import make_server

    server = make_server(reward_fn, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_flux_full_finetune_with_kl_and_reward_server(tmp_path, capsys):
    from jagg.rewards.registry import jpeg_compressibility

    pipe = diffusers.FluxPipeline(transformer=tiny_flux(), scheduler=FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True), vae=tiny_vae(), text_encoder=None, tokenizer=None, text_encoder_2=None,
        tokenizer_2=None)
    pipe.save_pretrained(tmp_path / "flux")
    cond, _ = embeds(prompts=("a red cube", "a blue ball"))
    cond.select([0, 2]).save(tmp_path / "cache.pt")                 # embeds() repeats each prompt twice
    (tmp_path / "prompts.txt").write_text("a red cube\na blue ball\n")
    server = _serve(jpeg_compressibility)
    try:
        (tmp_path / "flux.yaml").write_text(f"""\
pipeline:
  family: flux
  path: {tmp_path / "flux"}
  dtype: fp32
  device: cpu
  resolution: 128
  num_steps: 4
  cfg_scale: 1.0
  guidance_embed: 3.5
  eta: 0.9
  prompt_cache: {tmp_path / "cache.pt"}
  keep_reference: true
  lora: {{enabled: false}}
reward_server: {{url: "http://127.0.0.1:{server.server_address[1]}", batch_size: 3, timeout: 30}}
sample: {{prompts_file: {tmp_path / "prompts.txt"}, prompts_per_iter: 2, group_size: 2}}
estimator: {{mode: jagg, window: 4, micro_batch: 4, clip_range: 0.2, kl_beta: 0.1, correction_p: 0.0}}
optim: {{lr: 0.001}}
grpo: {{iterations: 1, updates_per_epoch: 2, drop_zero_spread: false}}
log: {{output_dir: {tmp_path / "run"}, tensorboard: false, progress: false}}
threads: 1
""")
        assert main(["train", "--config", str(tmp_path / "flux.yaml")]) == 0
        (r,) = records(tmp_path / "run")
        assert np.isfinite(r["reward_mean"]) and r["reward_mean"] < 0 and np.isfinite(r["loss"])
        assert r["kl"] > 0 and r["backward_items"] == 4 * 2                  # one JAGG group of 4 steps
        ck = tmp_path / "run" / "checkpoints"
        # full fine-tuning: no adapter; the transformer exported with its own save_pretrained
        assert sorted(p.name for p in ck.iterdir()) == ["ckpt_000001.pt", "transformer_000001"]
        state = torch.load(ck / "ckpt_000001.pt", weights_only=False)
        start = dict(tiny_flux().named_parameters())
        assert set(state["model"]) == set(start)                            # every weight is trained
        assert any(not torch.equal(state["model"][n], start[n]) for n in start)
        exported = dict(diffusers.FluxTransformer2DModel.from_pretrained(ck / "transformer_000001").named_parameters())
        assert all(torch.equal(exported[n], state["model"][n]) for n in start)
        # a training prompt missing from the prompt cache (no text encoders) is named before anything runs
        (tmp_path / "prompts.txt").write_text("a red cube\na purple cone\n")
        assert main(["train", "--config", str(tmp_path / "flux.yaml"), "--output-dir", str(tmp_path / "r2")]) == 2
        assert "'a purple cone'" in capsys.readouterr().err
    finally:
        server.shutdown()


def test_accelerate_two_cpu_processes_make_the_one_process_update(tmp_path, sd3_dir):
    """`accelerate launch --multi_gpu --num_processes 2` of `jagg train` on a CPU-only machine (torchrun under the hood,
    gloo, DDP): 2 real processes, each sampling half of the global batch, end with identical replicas that made the same
    update as 1 process on the whole batch (one update per epoch, KL term on). The blue ball's group has zero spread
    and is dropped: rank 1 trains no sample (it joins the all-reduce with a zero-gradient call), rank 0 two, and the
    update is still the one-process update; process 0 audits its own samples alone, and nothing changes."""
    import sys

    cfg = write_sd3_config(tmp_path, sd3_dir)
    (tmp_path / "two_prompts.txt").write_text("a red cube\na blue ball\n")
    sets = ["grpo.iterations=1", "grpo.updates_per_epoch=1", "grpo.drop_zero_spread=true", "sample.micro_batch=2",
            f"sample.prompts_file={tmp_path / 'two_prompts.txt'}", "log.sample_images=0",
            "reward.name=reward_plugins:blue_is_dark"]
    args = ["train", "--config", str(cfg)] + [a for s in sets for a in ("--set", s)]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(args + ["--output-dir", str(one)]) == 0
    # plain `--cpu --num_processes 2` starts ONE process (accelerate's multi-CPU path needs mpirun); --multi_gpu
    # runs torch.distributed.run, which on a machine without CUDA gives 2 CPU processes on gloo
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(free_port()), str(Path(__file__).parent / "real_train_launch.py")]
    audited = ["--set", "estimator.meter_every=1", "--set", "estimator.meter_samples=2"]   # process 0's own audit
    proc = run_launch(launch + args + audited + ["--output-dir", str(two)], env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (r1,), (r2,) = records(one), [r for r in records(two) if r["kind"] == "train"]
    assert [r["kind"] for r in records(two)] == ["audit", "train"]    # the audit changed nothing (its own RNG)
    assert (r1["processes"], r2["processes"]) == (1, 2) and r1["samples"] == r2["samples"] == 4
    assert r1["trained_samples"] == r2["trained_samples"] == 2 and r1["updates"] == r2["updates"] == 1
    assert_same_update(r2, r1)
    (rank0, rank1), engines = zip(*((s["weights"], s["engine"]) for s in (torch.load(two / f"rank{r}.pt")
                                                                          for r in (0, 1))))
    assert engines == ("ddp", "ddp")
    ck1, ck2 = (torch.load(d / "checkpoints" / "ckpt_000001.pt", weights_only=False) for d in (one, two))
    assert set(rank0) == set(rank1) == set(ck1["model"]) == set(ck2["model"])
    g_max = max(float(s["exp_avg"].abs().max()) for s in ck1["optimizer"]["state"].values())
    for i, n in enumerate(ck1["model"]):
        torch.testing.assert_close(rank1[n], rank0[n], rtol=0, atol=0)                  # identical replicas
        torch.testing.assert_close(ck2["model"][n], rank0[n], rtol=0, atol=0)           # rank 0 wrote them
        # the gradient (AdamW's first moment after one step: 0.1 g) of 2 processes is the 1-process one ...
        g1, g2 = (c["optimizer"]["state"][i]["exp_avg"] for c in (ck1, ck2))
        torch.testing.assert_close(g2, g1, rtol=1e-4, atol=1e-5 * g_max, msg=n)
        # ... and so is the update; AdamW's first step is lr g / (|g| + eps): entries with |g| near eps = 1e-8 may
        # differ by a few percent of lr = 0.01 when g differs by rounding
        torch.testing.assert_close(rank0[n], ck1["model"][n], rtol=0, atol=5e-4, msg=n)
    assert max(float(w.abs().max()) for n, w in rank0.items() if "lora_B" in n) > 5e-3   # lora_B left 0: it trained


def test_sampling_pieces_do_not_depend_on_the_process_count():
    """The SDE noise is seeded per sampling piece (global start): with shards that are whole pieces, 1 and 2 processes
    sample the same pieces; otherwise the pieces are cut at the shard edge, and no two share a start (a seed)."""
    from jagg.trainers.diffusers_trainer import sampling_pieces
    from jagg.infra.distributed import shard

    one = sampling_pieces(shard(8, 0, 1), 2)
    two = [p for r in (0, 1) for p in sampling_pieces(shard(8, r, 2), 2)]
    assert one == two == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    cut = [p for r in (0, 1) for p in sampling_pieces(shard(6, r, 2), 4)]
    assert cut == [slice(0, 3), slice(3, 4), slice(4, 6)] and len({p.start for p in cut}) == len(cut)


def test_the_hooks_train_in_memory_as_the_trainer_does(tmp_path, sd3_dir):
    """DiffusersGRPO is the diffusers trainer's hooks without a run directory, as ShapesGRPO is the shapes trainer's:
    its iterations write nothing and are the trainer's (the same rewards, losses and trained weights)."""
    cfg = train_config.load_config(write_sd3_config(tmp_path, sd3_dir), [f"log.output_dir={tmp_path / 'run'}"])
    grpo = real_train.DiffusersGRPO(cfg)
    in_memory = [grpo.step() for _ in range(2)]
    assert not (tmp_path / "run").exists() and grpo.logger is None
    trainer = real_train.DiffusersTrainer(cfg)
    in_run = [trainer.step() for _ in range(2)]
    for got, want in zip(in_memory, in_run):
        assert got["reward_mean"] == want["reward_mean"] and got["loss"] == want["loss"]
        assert got["trained_samples"] == want["trained_samples"] == 4 and got["updates"] == want["updates"] == 2
    assert all(torch.equal(a, b) for a, b in zip(grpo.params, trainer.params))
    assert not torch.equal(grpo.params[-1], real_train.DiffusersSampler(cfg).params[-1])   # they trained


def test_audit_and_unbiased_jagg_on_a_real_model(tmp_path, sd3_dir, captured):
    """estimator.meter_every=1 logs an audit record per iteration (cosines per third, rows, seconds); unbiased JAGG
    with correction_p=1 corrects every routed interval, so the audit finds the exact gradient (cosine 1)."""
    cfg = write_sd3_config(tmp_path, sd3_dir)
    out = tmp_path / "audited"
    sets = ["estimator.meter_every=1", "estimator.meter_samples=2", "estimator.correction_p=1.0",
            "estimator.kl_beta=0.0", "estimator.clip_range=100.0"]
    assert main(["train", "--config", str(cfg), "--output-dir", str(out)] + [a for s in sets for a in ("--set", s)]) == 0
    audits = [r for r in records(out) if r["kind"] == "audit"]
    assert [r["iteration"] for r in audits] == [1, 2]
    for r in audits:     # meter_samples 2, but whole GRPO groups and at least two of them: 2 groups of 2
        assert r["samples"] == 4 and r["rows"] > 0 and r["flagged"] == 0
        assert r["cos"] == pytest.approx(1.0, abs=1e-4)
        assert r["rows_exact"] == r["rows_estimator"] and r["error_to_noise"] < 1e-6     # p = 1: no error, no saving
        assert r["predicted_efficiency"] == pytest.approx(1.0, abs=1e-6)
    train = [r for r in records(out) if r["kind"] == "train"]
    assert all(r["backward_items"] == 4 * 4 for r in train)   # p = 1: every inner step also runs exactly


def test_qwen_image_lora_train_with_text_encoder_and_true_cfg(tmp_path, qwen_dir, captured):
    """`jagg train` on a tiny Qwen-Image directory: its text encoder embeds the prompts (and the negative prompt ' '),
    true CFG 4 in sampling and training, DanceGRPO's SDE, 4 of 5 steps trained in step groups of 2 interpolated by
    index, a weighted mix of PickScore (a tiny CLIP, in-process) and JPEG compressibility; the LoRA adapter it saves
    loads into QwenImagePipeline and gives the trained policy's velocity."""
    from tiny_clip import save_tiny_clip

    (tmp_path / "clip").mkdir()
    clip = save_tiny_clip(tmp_path / "clip")
    (tmp_path / "prompts.txt").write_text("a red cube\na blue ball on a table\n")
    cfg = tmp_path / "qwen.yaml"
    cfg.write_text(f"""\
pipeline:
  family: qwen_image
  path: {qwen_dir}
  dtype: fp32
  device: cpu
  resolution: 128
  num_steps: 5
  shift: 3.0
  eta: 0.3
  cfg_scale: 4.0
  negative_prompt: " "
  max_sequence_length: 512
  lora: {{rank: 2}}
reward: {{weights: {{"pickscore:path={clip},batch_size=3": 1.0, jpeg_compressibility: 0.1}}}}
sample: {{prompts_file: {tmp_path / "prompts.txt"}, prompts_per_iter: 2, group_size: 2, timestep_fraction: 0.8,
         sde_type: dance, shared_noise: true, micro_batch: 4}}
estimator: {{mode: jagg, window: 2, alpha: index, intermediate: fresh, micro_batch: 4, clip_range: 0.1,
            correction_p: 0.0}}
optim: {{lr: 0.01, max_grad_norm: 10.0}}
grpo: {{iterations: 1, drop_zero_spread: false}}
log: {{output_dir: {tmp_path / "run"}, tensorboard: false, progress: false}}
threads: 1
""")
    assert main(["train", "--config", str(cfg)]) == 0
    (r,) = records(tmp_path / "run")
    assert np.isfinite(r["reward_mean"]) and np.isfinite(r["loss"]) and r["grad_norm"] > 0
    assert r["reward_mean"] == pytest.approx(r["reward/pickscore"] + 0.1 * r["reward/jpeg_compressibility"], rel=1e-5)
    assert r["backward_items"] == 4 * 4                              # 4 samples x 2 groups x 2 endpoint rows
    trainer, _, _ = captured[0]
    pickscore = trainer.reward_fn.fn.parts["pickscore"].fn         # on the trainer's device, in pipeline.dtype
    assert pickscore.device == torch.device("cpu") and pickscore.model.dtype == torch.float32
    policy = trainer.policy
    assert policy.shift == 3.0 and policy.shift_terminal is None     # an explicit shift is static
    pipe = diffusers.QwenImagePipeline.from_pretrained(qwen_dir, text_encoder=None, tokenizer=None, vae=None)
    pipe.load_lora_weights(str(tmp_path / "run" / "checkpoints" / "adapter_000001"))
    prompts = ["a red cube", "a blue ball on a table"]
    v = policy.velocity(prompts)
    x, s, i = torch.randn(2, 4, 16, 16), torch.tensor([0.7, 0.3]), torch.arange(2)
    with torch.no_grad():
        want = v(x, s, i)
        got = v.with_transformer(pipe.transformer)(x, s, i)
    assert (want - policy.reference(v)(x, s, i)).abs().max() > 1e-5     # the adapters trained: not the base model
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)



def test_a_sliding_sde_window_and_wandb_on_a_real_model(tmp_path, sd3_dir, captured, monkeypatch):
    """The diffusers trainer moves a sliding SDE window by the iteration (logged as sde_window_start; 2 of its 4 steps
    sampled with the SDE and trained) and, with log.wandb, logs its records and its sample grids to wandb."""
    import fake_wandb

    calls = fake_wandb.install(monkeypatch)
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)          # online mode (the default) needs a key: a logged-in user
    cfg = write_sd3_config(tmp_path, sd3_dir)
    out = tmp_path / "sliding"
    sets = ["sample.sde_window_schedule=sliding", "sample.sde_window_size=2", "sample.sde_window_every=1",
            "log.wandb=true"]
    assert main(["train", "--config", str(cfg), "--output-dir", str(out)] + [a for s in sets for a in ("--set", s)]) == 0
    train = [r for r in records(out) if r["kind"] == "train"]
    assert [r["sde_window_start"] for r in train] == [0, 1]
    assert all(r["backward_items"] == 4 * 2 for r in train)    # 4 samples x 2 steps (a 2-step group: exact rows)
    logs = [c[1] for c in calls if c[0] == "log"]
    assert [d["train/sde_window_start"] for d in logs if "train/sde_window_start" in d] == [0, 1]
    grids = [(d["iteration"], Path(d["images/rollouts"].path).name) for d in logs if "images/rollouts" in d]
    assert grids == [(1, "iter_000001.png"), (2, "iter_000002.png")]


def test_the_lr_schedule_runs_in_the_diffusers_trainer(tmp_path, sd3_dir):
    """optim.lr_schedule is the shared loop's: the diffusers trainer logs the scheduled lr (1 iteration x 2 updates,
    linear: factors 1 and 1/2; the record: their mean)."""
    cfg = write_sd3_config(tmp_path, sd3_dir)
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--output-dir", str(out), "--set", "optim.lr_schedule=linear",
                 "--set", "grpo.iterations=1"]) == 0
    assert [r["lr"] for r in records(out)] == pytest.approx([0.0075])


def test_a_run_trains_on_flow_grpos_rewards_with_its_jsonl_metadata(tmp_path, sd3_dir):
    """A tiny SD3 run on a .jsonl prompt set, rewarded by the GenEval server, the OCR reward and the VLM judge in a
    weighted sum: the server gets each prompt's object as its metadata, and each reward is logged."""
    lines = [{"prompt": 'a sign that says "HI"', "tag": "single_object", "include": [{"class": "sign", "count": 1}]},
             {"prompt": 'a red "cube"', "tag": "color_attr", "include": [{"class": "cube", "count": 1}]}]
    (tmp_path / "train_metadata.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = write_sd3_config(tmp_path, sd3_dir)
    judge, _ = judge_server(lambda p: f"Final Score: {len(p) % 5 + 1}")
    with serving(geneval_answer) as (geneval, sent), serving(judge) as (vlm, asked):
        cfg.write_text(cfg.read_text().replace("reward:\n  name: jpeg_compressibility\n", f"""reward:
  weights:
    "flow_grpo_remote:url={geneval},batch_size=3": 1.0
    "ocr:engine=reward_plugins:StubOcr": 0.5
    "vlm_judge:base_url={vlm}/v1,image_size=16,concurrency=2": 0.25
""").replace(str(tmp_path / "prompts.txt"), str(tmp_path / "train_metadata.jsonl")))
        assert main(["train", "--config", str(cfg), "--output-dir", str(tmp_path / "run"), "--set",
                     "grpo.iterations=1", "--set", "grpo.updates_per_epoch=1"]) == 0
        metas = [m for _, _, body in sent for m in pickle.loads(body)["meta_datas"]]
        assert len(metas) == 4 and all(m in lines for m in metas)              # 2 prompts x 2 images
        assert len(asked) == 4
    (r,) = records(tmp_path / "run")
    assert {"reward/flow_grpo_remote", "reward/ocr", "reward/vlm_judge"} <= set(r)
    assert all(np.isfinite(r[k]) for k in ("reward/flow_grpo_remote", "reward/ocr", "reward/vlm_judge", "loss"))
    np.testing.assert_allclose(r["reward/vlm_judge"], np.mean([(len(x["prompt"]) % 5 + 1) / 5 for x in lines]))
