"""jagg: Jacobian-Aggregated Group Gradient for GRPO fine-tuning of flow-matching models."""

__version__ = "0.1.0"
