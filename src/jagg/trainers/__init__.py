"""The two GRPO trainers of ``jagg train``, side by side: one config and one trainer per model kind, and the loop
they share once.

- :mod:`~jagg.trainers.loop`: :class:`~jagg.trainers.loop.GRPO`, one iteration (advantages, updates, audit) and the
  hooks a trainer fills, and :class:`~jagg.trainers.loop.GRPOTrainer`, the loop in a run directory (iterations,
  checkpoints, signals) with ``run()``, how ``jagg train`` starts either trainer;
- :mod:`~jagg.trainers.rollout`: what the loop passes along (the draw, the rollout, its batch, the minibatches, the
  iteration's outcome) and :func:`~jagg.trainers.rollout.rollout_batch`, the rollout pipeline the benches share;
- :mod:`~jagg.trainers.resume`: whether a checkpoint's run may continue under the current config;
- :mod:`~jagg.trainers.sections`: the config sections both share (estimator, optim, grpo, reward, log);
- :mod:`~jagg.trainers.shapes_trainer` + :mod:`~jagg.trainers.shapes_config`: the TinyDiT on the embedded shapes
  world (the main job), with the sampler the benchmarks share;
- :mod:`~jagg.trainers.diffusers_trainer` + :mod:`~jagg.trainers.diffusers_config`: SD3/SD3.5, FLUX.1 and Qwen-Image
  through diffusers, for a config with a ``pipeline:`` section
  (:func:`~jagg.trainers.diffusers_config.has_pipeline_section`).

The modules load on demand (the diffusers trainer needs the ``diffusers`` extra only when it runs)."""
