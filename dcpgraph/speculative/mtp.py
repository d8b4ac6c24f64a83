"""``method="mtp"``: DeepSeek-V3-style multi-token-prediction layers — checked, not yet built.

A checkpoint that carries ``num_nextn_predict_layers`` extra layers (embedding norm, hidden norm,
projection of their concatenation, one decoder layer, the shared head) could draft from the
target's last hidden states. This build does not run them: :func:`check_mtp` refuses the
method before any work, with the reason (no MTP layers in the checkpoint, or MTP drafting not
implemented), and names the methods that do work.
"""

from __future__ import annotations

from ..errors import ConfigError


def check_mtp(facts) -> None:
    layers = int(facts.extra.get("num_nextn_predict_layers") or 0)
    if layers <= 0:
        raise ConfigError(f"speculative method 'mtp' needs a checkpoint with multi-token-prediction layers "
                          f"(num_nextn_predict_layers > 0); {facts.architecture} has none. Use method 'ngram' "
                          "or 'draft_model'")
    raise ConfigError(f"{facts.architecture} has {layers} MTP layer(s), but MTP drafting is not implemented in "
                      "this build; use method 'ngram' or 'draft_model'")
