"""jagg: Jacobian-Aggregated Group Gradient for GRPO fine-tuning of flow-matching models."""

from .advantages import group_advantages, nonzero_spread_mask
from .audit import audit_gradient
from .estimator_config import EstimatorConfig
from .estimator import GradientStats, policy_gradient, reference_velocities
from .schedule import flow_sigmas, shift_sigmas
from .sde import euler_step, gaussian_log_prob, sde_step, step_loss
from .trajectory import Trajectory, sample_ode, sample_trajectories, select_train_steps, sliding_sde_window

__version__ = "0.1.0"

__all__ = [
    "EstimatorConfig", "GradientStats", "audit_gradient", "Trajectory", "euler_step", "flow_sigmas", "gaussian_log_prob",
    "group_advantages", "nonzero_spread_mask", "policy_gradient", "reference_velocities", "sample_trajectories",
    "sample_ode", "sde_step", "select_train_steps", "shift_sigmas", "sliding_sde_window", "step_loss",
]
