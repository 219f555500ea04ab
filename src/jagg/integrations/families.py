"""The diffusers model families jagg trains, one :class:`Family` record each: everything the rest of
:mod:`jagg.integrations` (and the cost model) knows about a family is read from its record.

A new diffusers DiT is one more record in :data:`FAMILIES` (:func:`register_family` for one defined outside jagg),
plus its velocity adapter in :mod:`jagg.integrations.velocity_adapters` if no existing one fits (a transformer another family
already has needs none). Plain data: nothing here imports torch or diffusers.

LoRA defaults are Flow-GRPO's (``scripts/train_sd3.py``, ``scripts/train_flux.py``,
``scripts/train_qwenimage_edit_plus.py`` in yifan123/flow_grpo):

==========  ====  =====  ================================================================================
family      rank  alpha  target modules
==========  ====  =====  ================================================================================
SD3/SD3.5   32    64     ``attn.add_k_proj, attn.add_q_proj, attn.add_v_proj, attn.to_add_out, attn.to_k,
                         attn.to_out.0, attn.to_q, attn.to_v``
FLUX.1      64    128    the SD3 list plus ``ff.net.0.proj, ff.net.2, ff_context.net.0.proj, ff_context.net.2``
Qwen-Image  64    128    the SD3 list (the joint attention of ``QwenImageTransformerBlock``: image ``to_q/k/v``,
                         ``to_out.0``; text ``add_q/k/v_proj``, ``to_add_out``) plus ``img_mlp.net.0.proj,
                         img_mlp.net.2, txt_mlp.net.0.proj, txt_mlp.net.2``
Wan 2.1     32    64     ``to_q, to_k, to_v, to_out.0``: self- (``attn1``) and cross-attention (``attn2``) of every
                         ``WanTransformerBlock`` (``scripts/train_wan2_1.py`` lists the SD3 names without the
                         ``attn.`` prefix; its ``add_*`` names exist only in the image-to-video model)
FLUX.2      64    128    not Flow-GRPO's (it has no FLUX.2 script): FLUX.1's choice carried over, the SD3 list plus
                         the MLPs ``ff.linear_in, ff.linear_out, ff_context.linear_in, ff_context.linear_out`` of the
                         double-stream blocks and the fused ``attn.to_qkv_mlp_proj`` of the single-stream blocks
                         (their ``attn.to_out`` is not matched: the name also ends a double-stream block's
                         ``ModuleList``)
==========  ====  =====  ================================================================================

LoRA initialisation is gaussian for all (``lora.init``). ``attn.to_q`` matches ``transformer_blocks.i.attn.to_q`` but
not SD3.5's second attention ``attn2``.
"""

from __future__ import annotations

from dataclasses import dataclass

SHIFT_RULES = ("calculate_shift", "empirical_mu", "scheduler")
POSITION_CHECKS = ("patch_grid", "rotary_axes", "rotary_table")


@dataclass(frozen=True)
class Family:
    """One model family (``pipeline.family``): its diffusers classes, how jagg samples and trains it.

    Attributes:
        name: the value of ``pipeline.family``.
        title: the family in words, for messages (``"FLUX.1"``).
        pipeline_class: the diffusers pipeline class (``model_index.json``'s ``_class_name``; what loads the model).
        pipeline_module: the module under ``diffusers.pipelines`` whose helpers (``retrieve_timesteps``,
            ``calculate_shift``, ``compute_empirical_mu``) say how the pipeline's ``__call__`` calls its scheduler.
        transformer_class: the diffusers transformer class, by which :func:`jagg.integrations.model_family`
            recognises a bare transformer (the first record that names it).
        adapter: the velocity adapter, a class of :mod:`jagg.integrations.velocity_adapters` (it also embeds the prompts:
            the adapter's ``encode``).
        lora_rank, lora_alpha, lora_targets: the LoRA defaults (module docstring).
        packed: the network takes 2x2-packed latent tokens (the adapter is a ``PackedVelocity``) and the pipeline
            passes explicit sigmas and a ``mu`` to its scheduler, dynamic shifting by default.
        video: latents have a frame axis ``[C, F, H/8, W/8]`` and decode to videos (``pipeline.num_frames``).
        guidance_embed: the embedded guidance the pipeline passes by default to a guidance-distilled transformer
            (``guidance_embeds: true``), or None for a family without guidance embeddings.
        shift_rule: how the pipeline's dynamic shift finds ``mu``: ``calculate_shift`` (linear in the image tokens),
            ``empirical_mu`` (``compute_empirical_mu`` of the image tokens and the steps), or ``scheduler`` (the
            pipeline calls ``set_timesteps(N)`` on its scheduler, no ``mu``).
        positions: which position-embedding limit :func:`jagg.integrations.model_dir.check_positions` checks:
            ``patch_grid`` (``pos_embed_max_size`` patches a side), ``rotary_axes`` (``rope_max_seq_len`` positions
            per axis, frames included), ``rotary_table`` (a 4096-position rotary table shared by image and text), or
            None (positions computed for any size).
        max_text_tokens: the most ``pipeline.max_sequence_length`` the pipeline accepts, or None.
        cost_preset: the :mod:`jagg.cost` preset ``--cost`` defaults to, or None for Flow-GRPO's SD3.5 (its full
            fine-tuning preset without LoRA).
    """

    name: str
    title: str
    pipeline_class: str
    pipeline_module: str
    transformer_class: str
    adapter: str
    lora_rank: int
    lora_alpha: float
    lora_targets: tuple[str, ...]
    packed: bool = False
    video: bool = False
    guidance_embed: float | None = None
    shift_rule: str = "calculate_shift"
    positions: str | None = None
    max_text_tokens: int | None = None
    cost_preset: str | None = None

    def __post_init__(self):
        if not self.name or not self.name.isidentifier():
            raise ValueError(f"a family's name must be an identifier (it is pipeline.family); got {self.name!r}")
        if self.shift_rule not in SHIFT_RULES:
            raise ValueError(f"family {self.name}: shift_rule must be one of {SHIFT_RULES}; got {self.shift_rule!r}")
        if self.positions is not None and self.positions not in POSITION_CHECKS:
            raise ValueError(f"family {self.name}: positions must be one of {POSITION_CHECKS} or None; got "
                             f"{self.positions!r}")
        if self.lora_rank < 1 or self.lora_alpha <= 0 or not self.lora_targets:
            raise ValueError(f"family {self.name}: LoRA defaults need rank >= 1, alpha > 0 and target modules")


ATTENTION = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k", "attn.to_out.0",
             "attn.to_q", "attn.to_v")
FLUX2_TARGETS = ATTENTION + ("ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
                             "attn.to_qkv_mlp_proj")


def _flux2(name: str, pipeline: str, module: str) -> Family:
    return Family(name, "FLUX.2", pipeline, f"flux2.{module}", "Flux2Transformer2DModel", "Flux2Velocity", 64, 128.0,
                  FLUX2_TARGETS, packed=True, guidance_embed=4.0, shift_rule="empirical_mu")


class FamilyTable(dict):
    """``{name: Family}``; looking up an unknown name is a ValueError naming ``pipeline.family`` and the known
    families (``FAMILIES[name]`` is the one way the code reads a record)."""

    def __missing__(self, name):
        raise ValueError(f"pipeline.family must be one of {tuple(self)}; got {name!r}")


FAMILIES: FamilyTable = FamilyTable({f.name: f for f in (
    Family("sd3", "SD3", "StableDiffusion3Pipeline", "stable_diffusion_3.pipeline_stable_diffusion_3",
           "SD3Transformer2DModel", "SD3Velocity", 32, 64.0, ATTENTION, positions="patch_grid"),
    Family("flux", "FLUX.1", "FluxPipeline", "flux.pipeline_flux", "FluxTransformer2DModel", "FluxVelocity", 64, 128.0,
           ATTENTION + ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"), packed=True,
           guidance_embed=3.5),
    Family("qwen_image", "Qwen-Image", "QwenImagePipeline", "qwenimage.pipeline_qwenimage",
           "QwenImageTransformer2DModel", "QwenImageVelocity", 64, 128.0,
           ATTENTION + ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"), packed=True,
           positions="rotary_table", max_text_tokens=1024, cost_preset="jagg_authors_qwen_image"),
    Family("wan", "Wan 2.1", "WanPipeline", "wan.pipeline_wan", "WanTransformer3DModel", "WanVelocity", 32, 64.0,
           ("to_q", "to_k", "to_v", "to_out.0"), video=True, shift_rule="scheduler", positions="rotary_axes",
           cost_preset="flow_grpo_wan"),
    _flux2("flux2", "Flux2Pipeline", "pipeline_flux2"),
    _flux2("flux2_klein", "Flux2KleinPipeline", "pipeline_flux2_klein"),
)})
DEFAULT_FAMILY = "sd3"                  # pipeline.family's default: Flow-GRPO's SD3.5-Medium


def register_family(record: Family) -> Family:
    """Add ``record`` to :data:`FAMILIES` (``pipeline.family: <record.name>`` then loads, samples and trains it);
    a name already taken is refused."""
    if record.name in FAMILIES:
        raise ValueError(f"model family {record.name!r} is already registered; pick another name")
    FAMILIES[record.name] = record
    return record
