"""What every run stands on, for both trainers and the benchmarks: run directories (``rundir``), atomic writes and
checkpoints, YAML config loading (``config_loader``), metrics and sample grids, wandb, processes (``distributed``) and
memory sizes. The trainers themselves are :mod:`jagg.trainers`."""
