"""A local diffusers model directory, checked before any weight loads: its files, their shape, and what the
``pipeline:`` section asks of the model they describe.

:func:`check_model_dir` checks the directory (``model_index.json``, ``transformer/config.json``, every JSON file valid,
each config a JSON object of the expected shape, the pipeline class against ``pipeline.family``);
:func:`check_settings` checks the section against the model's own config files: the resolution (and a video's frame
count) against the transformer's position embeddings (SD3's ``pos_embed_max_size``, Wan's ``rope_max_seq_len``,
Qwen-Image's rotary table of 4096 positions), and ``pipeline.guidance_embed`` against a guidance-distilled
transformer (``guidance_embeds``: FLUX.1-dev, FLUX.2 [dev]). :func:`check_model` is both, and is what every loader
and ``jagg train`` call: each problem is one error naming the config key or the file, with what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..checks import check_json_files, read_json
from .config import PipelineConfig
from .families import FAMILIES

QWEN_ROPE_POSITIONS = 4096          # QwenEmbedRope's table (diffusers: torch.arange(4096)), image and text positions
HINT = ("download it once on a machine with internet, e.g. `huggingface-cli download "
        "stabilityai/stable-diffusion-3.5-medium --local-dir /models/sd3.5-medium` (FLUX: "
        "black-forest-labs/FLUX.1-dev; Qwen-Image: Qwen/Qwen-Image; Wan 2.1: Wan-AI/Wan2.1-T2V-1.3B-Diffusers; "
        "FLUX.2: black-forest-labs/FLUX.2-dev or FLUX.2-klein-base-4B), copy it here and set pipeline.path")


@dataclass
class ModelFiles:
    """The config files of a model directory: ``index`` (``model_index.json``), ``transformer`` (its
    ``config.json``), ``scheduler`` and ``vae`` (their configs, or None where the directory has none)."""

    path: Path
    index: dict
    transformer: dict
    scheduler: dict | None = None
    vae: dict | None = None


def _object(path: Path, what: str, expected: str) -> dict:
    """The JSON object in ``path`` (:func:`jagg.checks.read_json`), or a ValueError naming the file and ``expected``."""
    data = read_json(path, what)
    if not isinstance(data, dict) or not data:
        got = "an empty object" if data == {} else f"a JSON {type(data).__name__}"
        raise ValueError(f"{what}: {path} holds {got}; expected {expected}. Repair the file or copy the model again")
    return data


def check_model_dir(path: str | Path, family: str) -> dict:
    """Raise a clear error unless ``path`` is a local diffusers model directory of ``family`` whose config files have
    the expected shape (:func:`read_model_files`); return its model_index."""
    return read_model_files(path, family).index


def read_model_files(path: str | Path, family: str) -> ModelFiles:
    """The config files of the diffusers model directory ``path`` of ``family``, each checked for its shape: a
    missing directory or file, a file that is not JSON or not the JSON object expected, and a pipeline class of
    another family are each an error naming the file (or ``pipeline.family``) and what was expected."""
    p = Path(path).expanduser() if path else None
    if p is None or not p.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist; jagg never downloads weights: {HINT}")
    if not p.is_dir():
        raise NotADirectoryError(f"model path {p} is a file; it must be a diffusers model directory "
                                 "(model_index.json, transformer/, vae/, ...), not a single checkpoint file")
    if not (p / "model_index.json").is_file():
        raise FileNotFoundError(f"{p} is not a diffusers model directory: no model_index.json. Point pipeline.path "
                                f"at the directory that contains model_index.json; {HINT}")
    if not (p / "transformer" / "config.json").is_file():
        raise FileNotFoundError(f"{p} has no transformer/ subfolder (transformer/config.json): it is not an SD3, "
                                "FLUX, Qwen-Image, Wan or FLUX.2 diffusers directory (UNet models such as SD1.5/SDXL "
                                "are not flow-matching DiTs)")
    what = f"pipeline.path {p}"
    check_json_files(p, what)                        # a broken config.json, named before diffusers reads it
    expected = FAMILIES[family].pipeline_class
    index = _object(p / "model_index.json", what, f"a JSON object with '_class_name' (the pipeline class, e.g. "
                    f"{expected!r}) and one [library, class] pair per component, e.g. \"transformer\": "
                    "[\"diffusers\", \"SD3Transformer2DModel\"]")
    found = index.get("_class_name")
    if not isinstance(found, str) or not found:
        raise ValueError(f"{what}: {p / 'model_index.json'} has no '_class_name' naming the pipeline class (expected "
                         f"{expected!r} for pipeline.family {family!r}); repair the file or copy the model again")
    known = {}
    for f in FAMILIES.values():
        known.setdefault(f.pipeline_class, f.name)
    if found in known and found != expected:
        raise ValueError(f"{p} holds a {found} but pipeline.family is {family!r}; set pipeline.family: "
                         f"{known[found]!r}")
    entry = index.get("transformer")
    if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry)):
        raise ValueError(f"{what}: {p / 'model_index.json'} has 'transformer': {entry!r}; expected a [library, class] "
                         "pair, e.g. [\"diffusers\", \"SD3Transformer2DModel\"]")
    transformer = _object(p / "transformer" / "config.json", what, "the transformer's config, a JSON object of its "
                          "arguments (num_layers, in_channels, ...)")
    optional = {}
    for name, file in (("scheduler", "scheduler_config.json"), ("vae", "config.json")):
        if (p / name / file).is_file():
            optional[name] = _object(p / name / file, what, f"the {name}'s config, a JSON object of its arguments")
    return ModelFiles(p, index, transformer, optional.get("scheduler"), optional.get("vae"))


def _vae_factors(vae: dict | None) -> tuple[int, int]:
    """Pixels per latent along each side and frames per latent frame, from a VAE config as the pipelines compute them
    (8 and 4 without one)."""
    if not vae:
        return 8, 4
    temporal = vae.get("temperal_downsample")
    if isinstance(temporal, list):                     # Qwen-Image's and Wan's video VAEs
        return 2 ** len(temporal), 2 ** sum(bool(t) for t in temporal)
    blocks = vae.get("block_out_channels")
    return (2 ** (len(blocks) - 1) if isinstance(blocks, list) and blocks else 8), 4


def _size(config: PipelineConfig) -> str:
    h, w = config.size
    return f"pipeline.resolution={h}" + (f" and pipeline.width={w}" if config.width is not None else "")


def check_positions(config: PipelineConfig, files: ModelFiles) -> None:
    """Raise, naming the key, when the resolution (a video's frame count) needs more positions than the transformer's
    position embeddings have (module docstring; the family record's ``positions`` says which); FLUX.1 and FLUX.2
    compute theirs for any size."""
    check = _POSITION_CHECKS.get(config.record.positions)
    if check is not None:
        spatial, temporal = _vae_factors(files.vae)
        h, w = (side // spatial for side in config.size)                # VAE latents
        check(config, files.transformer, files.path / "transformer" / "config.json", (h, w, spatial, temporal))


def _patch_grid(config: PipelineConfig, t: dict, where: Path, latents: tuple[int, int, int, int]) -> None:
    """SD3's learned position embeddings: ``pos_embed_max_size`` patches a side."""
    h, w, spatial, _ = latents
    if isinstance(t.get("pos_embed_max_size"), int):
        patch, limit = int(t.get("patch_size", 2)), t["pos_embed_max_size"]
        if max(h, w) // patch > limit:
            raise ValueError(f"{_size(config)} is more than this {config.record.title} transformer takes: its position "
                             f"embeddings cover {limit} x {limit} patches (pos_embed_max_size in {where}), "
                             f"{limit * patch * spatial} pixels a side at patch size {patch} and VAE factor {spatial}; "
                             f"lower the resolution to at most {limit * patch * spatial}")


def _rotary_axes(config: PipelineConfig, t: dict, where: Path, latents: tuple[int, int, int, int]) -> None:
    """Wan's rotary positions: ``rope_max_seq_len`` per axis, latent frames included."""
    h, w, spatial, temporal = latents
    patch = t.get("patch_size", [1, 2, 2])
    limit = int(t.get("rope_max_seq_len", 1024))
    frames = (config.frames - 1) // temporal + 1
    if frames // int(patch[0]) > limit:
        most = (limit * int(patch[0]) - 1) * temporal + 1
        raise ValueError(f"pipeline.num_frames={config.frames} ({frames} latent frames) is more than this "
                         f"{config.record.title} transformer's {limit} rotary positions (rope_max_seq_len in {where}) "
                         f"take; lower it to at most {most}")
    if max(h // int(patch[1]), w // int(patch[2])) > limit:
        raise ValueError(f"{_size(config)} is more than this {config.record.title} transformer's {limit} rotary "
                         f"positions a side (rope_max_seq_len in {where}) take; lower it to at most "
                         f"{limit * int(patch[1]) * spatial}")


def _rotary_table(config: PipelineConfig, t: dict, where: Path, latents: tuple[int, int, int, int]) -> None:
    """Qwen-Image's rotary table of 4096 positions, half the packed image side plus the text tokens."""
    h, w, _, _ = latents
    side = max(h, w) // 2                                               # packed 2x2 latent tokens a side
    if side // 2 + config.max_sequence_length > QWEN_ROPE_POSITIONS:
        raise ValueError(f"{_size(config)} with pipeline.max_sequence_length={config.max_sequence_length} is more "
                         f"than {config.record.title}'s rotary table of {QWEN_ROPE_POSITIONS} positions takes (half "
                         "the packed image side plus the text tokens); lower the resolution")


_POSITION_CHECKS = {"patch_grid": _patch_grid, "rotary_axes": _rotary_axes, "rotary_table": _rotary_table}


def check_guidance(config: PipelineConfig, files: ModelFiles) -> None:
    """Raise, naming ``pipeline.guidance_embed``, when a guidance-distilled transformer (``guidance_embeds: true`` in
    its config: FLUX.1-dev, FLUX.2 [dev]) is given none, or a transformer without guidance embedding is given one."""
    record = config.record
    if record.guidance_embed is None:
        return
    distilled = bool(files.transformer.get("guidance_embeds", False))
    where = files.path / "transformer" / "config.json"
    default = record.guidance_embed
    if distilled and config.guidance_embed is None:
        raise ValueError(f"pipeline.guidance_embed is required: this {record.pipeline_class} transformer is "
                         f"guidance-distilled (guidance_embeds: true in {where}) and takes the guidance as an "
                         f"embedding; set pipeline.guidance_embed: {default} (the pipeline's default guidance_scale)")
    if not distilled and config.guidance_embed is not None:
        raise ValueError(f"pipeline.guidance_embed={config.guidance_embed} but this transformer has no guidance "
                         f"embedding (guidance_embeds: false in {where}); set it to null (pipeline.cfg_scale is "
                         "classifier-free guidance)")


def check_model(config: PipelineConfig) -> ModelFiles:
    """The model directory of ``config`` and the section against it (:func:`read_model_files`,
    :func:`check_positions`, :func:`check_guidance`), before any weight loads; returns its files."""
    files = read_model_files(config.path, config.family)
    check_positions(config, files)
    check_guidance(config, files)
    return files
