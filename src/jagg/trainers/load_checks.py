"""What ``jagg train`` on a real model checks before the model's weights load and before the run directory is touched
(the prompt files are read when the config loads): the model directory and what the ``pipeline:`` section asks of it
(:func:`jagg.integrations.model_dir.check_model`: config files of the expected shape, the resolution and frame count
against the transformer's position embeddings, the embedded guidance), the starting adapter ``pipeline.lora.path`` in
either format (:func:`jagg.integrations.lora_files.check_adapter`: its weights file's header readable, LoRA tensors in
it, the rank of ``pipeline.lora.rank``), the prompt-embedding cache, and a reward server's reachability (one ``GET
/health`` with a short timeout). Each problem is one error naming the key; nothing is written.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..integrations.lora_files import check_adapter
from ..integrations.model_dir import ModelFiles, check_model
from ..rewards.client import RewardClient, RewardServerError

HEALTH_TIMEOUT = 10.0             # seconds the health request may take (the scoring requests have reward_server.timeout)


def check_reward_server(client: RewardClient, timeout: float = HEALTH_TIMEOUT) -> dict:
    """One ``GET /health`` to the server of ``client`` within ``min(timeout, client.timeout)`` seconds -> its answer;
    an unreachable server, a wrong token or an answer that is not the server's is a ValueError naming
    ``reward_server.url``."""
    probe = dataclasses.replace(client, timeout=min(timeout, client.timeout))
    try:
        answer = probe.health()
    except RewardServerError as e:
        raise ValueError(f"reward_server.url {client.url} does not answer: {e.cause}; start the server (python -m "
                         "jagg.rewards.server --reward ...) or fix reward_server.url (and reward_server.token)") from None
    if answer.get("status") != "ok":
        raise ValueError(f"reward_server.url {client.url}: GET /health answered {str(answer)[:200]}, not a jagg reward "
                         "server's {\"status\": \"ok\", ...}; check the URL")
    return answer


def check_before_loading(cfg) -> ModelFiles:
    """The checks of the module docstring on a :class:`jagg.trainers.diffusers_config.DiffusersTrainConfig`;
    returns the model directory's config files."""
    p = cfg.pipeline
    files = check_model(p)
    if p.lora.enabled and p.lora.path is not None:
        check_adapter(p.lora.path, "pipeline.lora.path", p.lora.rank)
    if p.prompt_cache is not None and not Path(p.prompt_cache).expanduser().is_file():
        raise FileNotFoundError(f"pipeline.prompt_cache {p.prompt_cache!r} is not a file; build it with python -m "
                                "jagg.integrations.pipeline cache, or set pipeline.prompt_cache: null")
    if cfg.reward_server is not None:
        check_reward_server(cfg.reward_server)
    return files
