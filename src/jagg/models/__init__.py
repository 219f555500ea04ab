"""Models: a tiny text-conditioned DiT (pixel space) and its checkpoint / guidance helpers."""

from jagg.models.dit import DiTConfig, TinyDiT, cfg_velocity, load_pretrained, save_pretrained

__all__ = ["DiTConfig", "TinyDiT", "cfg_velocity", "load_pretrained", "save_pretrained"]
