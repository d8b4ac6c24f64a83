"""dcpgraph's implementation for ``transformers.AttentionInterface``.

While a model is traced with ``attn_implementation="dcpgraph"``, every attention call becomes one
``torch.ops.dcpgraph.attention`` node carrying its scale and causality. Every argument HF hands
over is checked: a feature the pipeline does not implement (a mask tensor, sliding windows,
soft-capping, sinks, positional biases such as ALiBi, non-causal attention, dropout…) raises
:class:`~dcpgraph.errors.UnsupportedModelError` naming the layer, instead of being dropped.
The matching ``AttentionMaskInterface`` entry builds no mask: causality is the op's own flag.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..errors import UnsupportedModelError

IMPLEMENTATION = "dcpgraph"

# Keyword arguments HF passes that do not change what attention computes.
_BENIGN_KWARGS = frozenset(
    {
        "position_ids", "use_cache", "cache_position", "output_attentions", "return_dict",
        "past_key_values", "past_key_value", "layer_idx", "token_type_ids", "is_causal",
        "output_hidden_states", "position_embeddings", "logits_to_keep",
    }
)

# Keyword arguments that, when set, mean a feature dcpgraph does not implement.
_FEATURES = {
    "sliding_window": "sliding-window attention",
    "softcap": "attention logit soft-capping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias (ALiBi / relative bias)",
    "alibi": "ALiBi",
    "head_mask": "a head mask",
    "cu_seq_lens_q": "packed varlen sequences",
    "cu_seq_lens_k": "packed varlen sequences",
}


def _where(module: torch.nn.Module) -> str:
    idx = getattr(module, "layer_idx", None)
    name = type(module).__name__
    return f"layer {idx} ({name})" if idx is not None else name


def dcpgraph_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF layout in (``[B, H, S, D]``), ``[B, S, H, Dv]`` out, as every HF attention function."""
    where = _where(module)
    if attention_mask is not None:
        raise UnsupportedModelError(f"{where}: an explicit attention mask tensor is not supported")
    if dropout:
        raise UnsupportedModelError(f"{where}: attention dropout ({dropout}) is not supported")
    for name, feature in _FEATURES.items():
        value_ = kwargs.get(name)
        if value_ is not None and value_ is not False:
            raise UnsupportedModelError(f"{where}: {feature} ({name}={value_!r}) is not supported")
    for name, value_ in kwargs.items():
        if name not in _BENIGN_KWARGS and name not in _FEATURES and value_ is not None:
            raise UnsupportedModelError(
                f"{where}: unrecognised attention argument {name}={type(value_).__name__}; "
                "dcpgraph refuses rather than guess what it changes"
            )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal:
        raise UnsupportedModelError(f"{where}: non-causal attention is not supported")
    if query.shape[1] % key.shape[1]:
        raise UnsupportedModelError(
            f"{where}: {query.shape[1]} query heads are not a multiple of {key.shape[1]} KV heads"
        )
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.dcpgraph.attention(query, key, value, scale, True)
    return out.transpose(1, 2).contiguous(), None


def no_mask(*args, **kwargs) -> None:
    """Mask builder for ``AttentionMaskInterface``: causality is carried by the attention op."""
    return None


_registered = False


def register() -> None:
    """Register the implementation with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, dcpgraph_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, no_mask)
    _registered = True


@contextlib.contextmanager
def using_dcpgraph_attention(model) -> Iterator[None]:
    """Temporarily switch ``model`` (and its sub-configs) to the dcpgraph attention."""
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATION)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
