"""The former home of the per-step Flow-GRPO loss head: :func:`step_loss` and :class:`StepLoss` live in
:mod:`jagg.sde`, beside the step's log-probability and moments they are built from (docs/design.md §2). This module
keeps ``jagg.loss.step_loss`` importable."""

from .sde import StepLoss, step_loss

__all__ = ["StepLoss", "step_loss"]
