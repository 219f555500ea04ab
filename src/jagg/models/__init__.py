"""Models: a tiny text-conditioned DiT (pixel space) and its checkpoint / guidance helpers."""

from jagg.models.dit import DiTConfig, TinyDiT, cfg_velocity, load_pretrained, save_pretrained
from jagg.models.velocity import GuidedVelocity

__all__ = ["DiTConfig", "GuidedVelocity", "TinyDiT", "cfg_velocity", "load_pretrained", "save_pretrained"]
