"""Sampling defaults from a checkpoint's ``generation_config.json``, as vLLM's
``--generation-config auto`` (its default) applies them: a request that omits ``temperature``,
``top_p``, ``top_k``, ``repetition_penalty`` or ``min_p`` samples with the checkpoint's value; a
value the request gives always wins. ``"vllm"`` ignores the file; a directory reads that
directory's ``generation_config.json`` instead of the model's."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

from ..errors import ConfigError
from .params import SamplingParams

log = logging.getLogger("dcpgraph.serving")
# generation_config.json's key -> SamplingParams' field (vLLM's get_diff_sampling_param)
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
          "repetition_penalty": "repetition_penalty", "min_p": "min_p"}


def generation_defaults(model_dir: str, generation_config: str | None = "auto") -> dict:
    """The SamplingParams fields ``generation_config.json`` sets (only those, and only fields
    SamplingParams has: a key it lacks is logged and left out). ``generation_config``: ``"auto"``
    (the model directory), ``"vllm"`` (none) or a directory."""
    if generation_config == "vllm":
        return {}
    folder = model_dir if generation_config in (None, "auto") else generation_config
    path = os.path.join(folder, "generation_config.json")
    if not os.path.exists(path):
        if folder != model_dir:
            raise ConfigError(f"--generation-config {folder}: no generation_config.json there")
        return {}
    with open(path) as f:
        config = json.load(f)
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    out = {}
    for key, field in FIELDS.items():
        if config.get(key) is None:
            continue
        if field not in known:
            log.warning("%s sets %s=%r, which dcpgraph does not sample with; ignored", path, key, config[key])
            continue
        out[field] = config[key]
    if out:
        log.info("default sampling parameters from %s (a request's own values win): %s", path, out)
    return out


def with_defaults(params: SamplingParams, given: set[str], defaults: dict) -> SamplingParams:
    """``params`` with every field of ``defaults`` the request did not give (``given``: the
    request's fields, explicit ``null`` excluded) replaced by its default (checked as any value)."""
    changes = {k: v for k, v in defaults.items() if k not in given}
    return dataclasses.replace(params, **changes) if changes else params
