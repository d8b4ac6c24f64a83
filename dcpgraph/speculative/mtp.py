"""``method="mtp"``: DeepSeek-V3-style multi-token-prediction layers — checked, not yet built.

A DeepSeek-V3 checkpoint with ``num_nextn_predict_layers = n`` stores, after its
``num_hidden_layers = L`` decoder layers, ``n`` extra layers ``model.layers.{L+i}.*``: ``enorm``
(embedding norm), ``hnorm`` (hidden-state norm), ``eh_proj`` (projection of their concatenation),
one decoder layer and ``shared_head`` (final norm and head). HF transformers' ``deepseek_v3``
drops those weights when loading, so an ``nn.Module`` or a traced Program never has them.

This build does not run MTP drafting: :func:`check_mtp` refuses the method before any work,
naming the reason — a model without MTP layers, a checkpoint whose files lack their weights, or
(when the weights are there) that MTP drafting is not implemented — and the methods that work.
"""

from __future__ import annotations

from ..errors import ConfigError

ALTERNATIVES = "use method 'ngram' or 'draft_model'"


def mtp_weight_prefixes(names, num_hidden_layers: int, layers: int) -> list[str]:
    """The ``model.layers.{L+i}.`` prefixes among ``names`` that carry an MTP layer's
    ``eh_proj.weight`` (the tensor only an MTP layer has)."""
    present = set(names)
    prefixes = [f"model.layers.{num_hidden_layers + i}." for i in range(layers)]
    return [p for p in prefixes if f"{p}eh_proj.weight" in present]


def check_mtp(facts, weight_names=None, num_hidden_layers: int | None = None) -> None:
    """Refuse ``method="mtp"`` with the reason. ``weight_names``: the checkpoint's tensor names
    (a model directory); ``None`` for an ``nn.Module`` or Program, which cannot hold them."""
    layers = int(facts.extra.get("num_nextn_predict_layers") or 0)
    if layers <= 0:
        raise ConfigError(f"speculative method 'mtp' needs a checkpoint with multi-token-prediction layers "
                          f"(num_nextn_predict_layers > 0); {facts.architecture} has none: {ALTERNATIVES}")
    if weight_names is None:
        raise ConfigError(f"speculative method 'mtp' reads the MTP layers' weights from a checkpoint directory; "
                          f"a {facts.architecture} module or Program has none (transformers drops them): "
                          f"{ALTERNATIVES}")
    found = mtp_weight_prefixes(weight_names, num_hidden_layers or facts.num_layers, layers)
    if len(found) < layers:
        raise ConfigError(f"the checkpoint declares num_nextn_predict_layers={layers} but holds MTP weights "
                          f"for {len(found)} layer(s) (no model.layers.N.eh_proj.weight): {ALTERNATIVES}")
    raise ConfigError(f"{facts.architecture}'s checkpoint has {layers} MTP layer(s), but MTP drafting is not "
                      f"implemented in this build: {ALTERNATIVES}")
