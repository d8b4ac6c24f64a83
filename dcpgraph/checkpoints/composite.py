"""The language model of a composite (vision-language) checkpoint.

Qwen3.5/3.6, Llama-4, Gemma-3/4, Mistral-3 and others ship as ``*ForConditionalGeneration``
checkpoints whose config nests a ``text_config`` beside a ``vision_config`` (or audio). dcpgraph
serves text: it builds the causal LM of the ``text_config`` alone (the vision tower is never built
or read) and finds its tensors under the language model's prefix in the checkpoint:
``model.language_model.X`` (transformers 5's layout) or ``language_model.model.X`` (older
saves) for the text model's ``model.X``, and ``lm_head.*`` or ``language_model.lm_head.*`` for its
head. :class:`LanguageModelFiles` is the checkpoint seen through that renaming: only the language
model's tensors, under the text model's own names.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedModelError

# (text model prefix, stored prefixes in the order they are tried)
LANGUAGE_PREFIXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model.", ("model.language_model.", "language_model.model.")),
    ("lm_head.", ("lm_head.", "language_model.lm_head.")),
)


def text_config_of(config):
    """The ``text_config`` of a composite config (one with sub-configs besides its text one),
    else None: a plain causal LM config is used as it is."""
    text = getattr(config, "text_config", None)
    if text is None or text is config:
        return None
    others = [k for k in (getattr(type(config), "sub_configs", None) or {}) if k != "text_config"]
    return text if others else None


def require_text_causal_lm(config, path: str) -> str:
    """The name of the causal LM class transformers builds for ``config`` (a text config);
    refused by name when there is none."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None))
    if name is None:
        raise UnsupportedModelError(
            f"{path}: the composite checkpoint's text_config (model_type {config.model_type!r}) has no causal LM "
            "in transformers to serve its language model with")
    return name


class LanguageModelFiles:
    """A :class:`~.tensor_sources.SafetensorsFiles` of a composite checkpoint seen as its text
    model's: ``names()`` are the language model's tensors under the text model's names; every
    other tensor (vision tower, projector) is invisible and never read."""

    def __init__(self, files):
        self.path = files.path
        self._files = files
        self._stored: dict[str, str] = {}
        stored_names = files.names()
        for model_prefix, candidates in LANGUAGE_PREFIXES:
            prefix = next((c for c in candidates if any(n.startswith(c) for n in stored_names)), None)
            if prefix is None:
                continue
            for name in stored_names:
                if name.startswith(prefix):
                    self._stored.setdefault(model_prefix + name[len(prefix):], name)
        if not any(n.startswith("model.") for n in self._stored):
            raise UnsupportedModelError(
                f"{files.path}: no language-model tensors under any of "
                f"{[c for _, cs in LANGUAGE_PREFIXES[:1] for c in cs]} in this composite checkpoint")

    def __contains__(self, name: str) -> bool:
        return name in self._stored

    def names(self) -> list[str]:
        return sorted(self._stored)

    def stored_name(self, name: str) -> str:
        return self._stored[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files.shape(self._stored[name])

    def read(self, name: str, dim: int | None, start: int = 0, stop: int = 0) -> torch.Tensor:
        return self._files.read(self._stored[name], dim, start, stop)
