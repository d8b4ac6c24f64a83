"""``speculative_config``: vLLM's shape, checked before any tracing, pass or collective.

``{"method": "ngram" | "draft_model" | "mtp", "num_speculative_tokens": k, ...}`` with, per method:

- ``ngram`` (prompt lookup): ``prompt_lookup_min`` / ``prompt_lookup_max`` (n-gram sizes tried,
  longest first; defaults 1 and 3), no ``model``;
- ``draft_model``: ``model``, a local HF model directory (or, from Python, an ``nn.Module`` or a
  Program from :func:`dcpgraph.trace`) sharing the target's tokenizer; no prompt-lookup keys;
- ``mtp``: the target checkpoint's own multi-token-prediction layers; no ``model``, no
  prompt-lookup keys.

:func:`speculative_config` returns a :class:`SpeculativeConfig` or ``None`` (no speculation), or
raises :class:`~dcpgraph.errors.ConfigError` naming the key, the value and the valid settings.
The deprecated compile option ``speculative_tokens=k`` (a ``DeprecationWarning``, see
:mod:`dcpgraph.options`) means ``{"method": "ngram", "num_speculative_tokens": k}``; giving both
is refused. This function's ``speculative_tokens`` argument is the engine's internal form of it.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..program import Program

METHODS = ("ngram", "draft_model", "mtp")
KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max")
DEFAULT_LOOKUP = (1, 3)  # n-gram sizes tried by prompt lookup, from the longest down


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: Any = None  # draft_model only
    prompt_lookup_min: int = DEFAULT_LOOKUP[0]  # ngram only
    prompt_lookup_max: int = DEFAULT_LOOKUP[1]

    def describe(self) -> dict:
        """JSON-able summary (the draft model by its path or type name)."""
        out: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            out.update(prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max)
        if self.method == "draft_model":
            out["model"] = self.model if isinstance(self.model, str) else type(self.model).__name__
        return out


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"speculative_config[{name!r}] must be an int >= 1, got {value!r}")
    return int(value)


def speculative_config(value: Any = None, speculative_tokens: int = 0) -> SpeculativeConfig | None:
    """The checked configuration, or ``None`` when speculation is off."""
    if isinstance(value, SpeculativeConfig) and not speculative_tokens:
        return value  # built by this function: already checked
    if value is None:
        if speculative_tokens:
            return SpeculativeConfig("ngram", speculative_tokens)
        return None
    if speculative_tokens:
        raise ConfigError("give speculative_config or the older speculative_tokens (which means "
                          "{'method': 'ngram', 'num_speculative_tokens': k}), not both")
    if not isinstance(value, Mapping):
        raise ConfigError(f"speculative_config must be a dict like {{'method': 'ngram', 'num_speculative_tokens': 3}}, "
                          f"got {type(value).__name__}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ConfigError(f"speculative_config has unknown keys {unknown}; valid keys: {list(KEYS)}")
    method = value.get("method")
    if method not in METHODS:
        raise ConfigError(f"speculative_config['method'] must be one of {list(METHODS)}, got {method!r}")
    if "num_speculative_tokens" not in value:
        raise ConfigError("speculative_config needs 'num_speculative_tokens' (draft tokens per step, an int >= 1)")
    k = _positive_int("num_speculative_tokens", value["num_speculative_tokens"])
    lookup_keys = [key for key in ("prompt_lookup_min", "prompt_lookup_max") if key in value]
    if method != "ngram" and lookup_keys:
        raise ConfigError(f"{lookup_keys} apply to method 'ngram' only, not {method!r}")
    if method == "ngram":
        if "model" in value:
            raise ConfigError("method 'ngram' drafts from the request's own tokens: it takes no 'model' "
                              "(use method 'draft_model' for a draft model)")
        low = _positive_int("prompt_lookup_min", value.get("prompt_lookup_min", DEFAULT_LOOKUP[0]))
        high = _positive_int("prompt_lookup_max", value.get("prompt_lookup_max", max(low, DEFAULT_LOOKUP[1])))
        if low > high:
            raise ConfigError(f"speculative_config: prompt_lookup_min ({low}) > prompt_lookup_max ({high})")
        return SpeculativeConfig("ngram", k, prompt_lookup_min=low, prompt_lookup_max=high)
    if method == "draft_model":
        return SpeculativeConfig("draft_model", k, model=_draft_model(value.get("model")))
    if "model" in value:
        raise ConfigError("method 'mtp' uses the target checkpoint's own MTP layers: it takes no 'model'")
    return SpeculativeConfig("mtp", k)


def _draft_model(model: Any) -> Any:
    import os

    import torch


    if model is None:
        raise ConfigError("method 'draft_model' needs 'model': a local HF model directory sharing the target's "
                          "tokenizer")
    if isinstance(model, str):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ConfigError(f"speculative_config['model'] {model!r} is not a local HF model directory "
                              "(no config.json)")
        return model
    if isinstance(model, (torch.nn.Module, Program)):
        return model
    raise ConfigError(f"speculative_config['model'] must be a model directory, an nn.Module or a Program, "
                      f"got {type(model).__name__}")
