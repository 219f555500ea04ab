"""Training infrastructure both trainers use: the trainer core, YAML config loading, shared config sections,
checkpoints, metrics and distributed helpers."""
