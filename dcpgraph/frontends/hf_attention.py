"""dcpgraph's implementation for ``transformers.AttentionInterface``.

While a model is traced with ``attn_implementation="dcpgraph"``, every attention call becomes one
``torch.ops.dcpgraph.attention`` node carrying its scale and causality. Every keyword HF hands
over is classified (:data:`SEMANTICS_FREE`, :data:`IMPLEMENTED`, :data:`REFUSED`, else unknown): a
semantics-free keyword never blocks a model; sliding windows, logit soft-capping, attention sinks and
chunked (block-local) layers become arguments of the op; a feature the pipeline does not implement (a mask tensor, positional
biases such as ALiBi, non-causal attention, dropout…) raises
:class:`~dcpgraph.errors.UnsupportedModelError` naming the layer, instead of being dropped.
The matching ``AttentionMaskInterface`` entry builds no mask: causality is the op's own flag.
The one exception is a model with a DeepSeek sparse-attention indexer (``config.index_topk``),
which reads the mask itself: it gets ``dcpgraph.causal_mask`` (remembered by identity, so the
attention call accepts exactly that tensor as "causal"), and its ``indices`` keyword (the
indexer's top-k) turns the call into ``dcpgraph.sparse_attention``; canonicalize then recognises
the indexer that computed them (:mod:`.canonicalize.sparse`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

from ..errors import UnsupportedModelError

IMPLEMENTATION = "dcpgraph"

# Every keyword HF passes to an attention implementation falls in exactly one of three classes.
# A keyword that is absent, ``None`` or ``False`` asks for nothing and is always accepted.
#
# 1. Semantics-free: bookkeeping that cannot change what attention computes, whatever its value.
SEMANTICS_FREE: dict[str, str] = {
    "position_ids": "positions are already applied to q/k (RoPE) before attention is called",
    "position_embeddings": "the RoPE cos/sin, already applied to q/k",
    "cache_position": "cache bookkeeping; dcpgraph owns the cache",
    "use_cache": "cache bookkeeping; dcpgraph owns the cache",
    "past_key_values": "cache bookkeeping; dcpgraph owns the cache",
    "past_key_value": "cache bookkeeping; dcpgraph owns the cache",
    "layer_idx": "an index, not a parameter of the math",
    "output_attentions": "asks for the probabilities as a second output; dcpgraph returns none",
    "output_hidden_states": "an output-collection flag of the decoder stack",
    "output_router_logits": "an output-collection flag of MoE routers",
    "return_dict": "an output-format flag",
    "logits_to_keep": "selects logits after the decoder stack",
    "num_items_in_batch": "a loss-normalisation count",
    "token_type_ids": "consumed by mask builders, which dcpgraph replaces by the causal flag",
    "deterministic": "a flash-attention kernel determinism switch",
    "max_length_q": "a packed-varlen length hint (packing itself is refused via cu_seq_lens_q)",
    "max_length_k": "a packed-varlen length hint (packing itself is refused via cu_seq_lens_k)",
    "is_causal": "checked together with the module's own flag (below); only causal is accepted",
}

# 2. Implemented: handled by the canonical op (checked explicitly in ``dcpgraph_attention``).
IMPLEMENTED: dict[str, str] = {
    "scaling": "the op's softmax scale",
    "dropout": "accepted at 0.0 (inference); any other value is refused",
    "attention_mask": "accepted when None or the front end's own causal mask; another tensor is refused",
    "indices": "the DSA indexer's top-k token indices: the call becomes dcpgraph.sparse_attention",
    "sliding_window": "the op's window: query at p sees keys at p − W < j <= p",
    "softcap": "the op's logit soft-cap: scores become c·tanh(s/c)",
    "s_aux": "the op's attention sinks: one learned logit per query head in the denominator",
    "sinks": "the op's attention sinks: one learned logit per query head in the denominator",
}

# 3. Refused: a feature dcpgraph does not implement, named in the error.
REFUSED: dict[str, str] = {
    "position_bias": "an additive position bias (ALiBi / relative bias)",
    "alibi": "ALiBi",
    "head_mask": "a head mask",
    "cu_seq_lens_q": "packed varlen sequences",
    "cu_seq_lens_k": "packed varlen sequences",
    "seq_idx": "packed varlen sequences",
    "block_indices": "block-sparse attention",
}
# Anything else is unknown and refused by name: dcpgraph does not guess what it changes.


def classify_keyword(name: str) -> str:
    """``"semantics-free"``, ``"implemented"``, ``"refused"`` or ``"unknown"``."""
    for kind, table in (("semantics-free", SEMANTICS_FREE), ("implemented", IMPLEMENTED), ("refused", REFUSED)):
        if name in table:
            return kind
    return "unknown"


def _asks_for_something(value: object) -> bool:
    return value is not None and value is not False


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
    if _callers is not None:
        _callers[id(module)] = getattr(module, "layer_idx", None)
    where = _where(module)
    if attention_mask is not None and not _is_own_mask(attention_mask):
        raise UnsupportedModelError(f"{where}: an explicit attention mask tensor is not supported")
    if dropout:
        raise UnsupportedModelError(f"{where}: attention dropout ({dropout}) is not supported")
    for name, value_ in kwargs.items():
        kind = classify_keyword(name)
        if kind == "refused" and _asks_for_something(value_):
            shown = f"{value_!r}" if not isinstance(value_, torch.Tensor) else f"Tensor{tuple(value_.shape)}"
            raise UnsupportedModelError(f"{where}: {REFUSED[name]} ({name}={shown}) is not supported")
        if kind == "unknown" and value_ is not None:
            raise UnsupportedModelError(
                f"{where}: unrecognised attention argument {name}={type(value_).__name__}; "
                "dcpgraph refuses rather than guess what it changes"
            )
    window, softcap, sinks = _modifiers(where, query.shape[1], kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal:
        raise UnsupportedModelError(f"{where}: non-causal attention is not supported")
    if query.shape[1] % key.shape[1]:
        raise UnsupportedModelError(
            f"{where}: {query.shape[1]} query heads are not a multiple of {key.shape[1]} KV heads"
        )
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    indices = kwargs.get("indices")
    chunk = _chunk_size(module)
    if chunk and (window or indices is not None):
        raise UnsupportedModelError(f"{where}: chunked attention with a sliding window or sparse indices "
                                    "is not supported")
    if indices is not None:
        present = [what for what, on in (("a sliding window", window), ("a soft-cap", softcap),
                                          ("attention sinks", sinks is not None)) if on]
        if present:
            raise UnsupportedModelError(
                f"{where}: sparse (indexed) attention with {' and '.join(present)} is not supported: the "
                "lightning-indexer path (DeepSeek-V3.2's) merges only the selected keys' partials")
        out = torch.ops.dcpgraph.sparse_attention(query, key, value, indices, scale)
        return out.transpose(1, 2).contiguous(), None
    extra = (window, softcap, sinks) if (window or softcap or sinks is not None or chunk) else ()
    out = torch.ops.dcpgraph.attention(query, key, value, scale, True, *extra, *((chunk,) if chunk else ()))
    return out.transpose(1, 2).contiguous(), None


def _chunk_size(module) -> int:
    """The chunk of a chunked-attention layer (Llama-4's ``layer_types[i] == "chunked_attention"``
    with ``attention_chunk_size``), else 0: HF builds that layer's block-local mask itself, which
    the front end's mask interface replaces by the causal flag, so the chunk is read from the
    layer's config."""
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None) or ()
    layer = getattr(module, "layer_idx", None)
    if layer is None or layer >= len(types) or types[layer] != "chunked_attention":
        return 0
    chunk = getattr(config, "attention_chunk_size", None)
    if not isinstance(chunk, int) or chunk < 1:
        raise UnsupportedModelError(f"{_where(module)}: a chunked-attention layer needs attention_chunk_size >= 1, "
                                    f"got {chunk!r}")
    return chunk


def _modifiers(where: str, q_heads: int, kwargs: dict) -> tuple[int, float, torch.Tensor | None]:
    """``(window, softcap, sinks)`` from HF's keywords, each checked (0 / 0.0 / None: off)."""
    window = kwargs.get("sliding_window")
    if window is None or window is False:
        window = 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise UnsupportedModelError(f"{where}: sliding_window must be a non-negative int, got {window!r}")
    softcap = kwargs.get("softcap")
    softcap = 0.0 if softcap is None else softcap
    if isinstance(softcap, torch.Tensor) or not float(softcap) >= 0.0:
        raise UnsupportedModelError(f"{where}: softcap must be a non-negative number, got {softcap!r}")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (q_heads,)):
        shown = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise UnsupportedModelError(f"{where}: attention sinks must be one logit per query head ({q_heads},), got {shown}")
    return window, float(softcap), sinks


_OWN_MASKS: dict[int, weakref.ref] = {}  # causal masks this module built, by identity


def _is_own_mask(mask: torch.Tensor) -> bool:
    ref = _OWN_MASKS.get(id(mask))
    return ref is not None and ref() is mask


def no_mask(*args, **kwargs) -> torch.Tensor | None:
    """Mask builder for ``AttentionMaskInterface``: causality is carried by the attention op, so
    no mask, except for a model whose sparse-attention indexer reads the mask and insists on one
    (``allow_is_causal_skip=False`` with a config declaring ``index_topk``): it gets a plain
    top-left causal ``dcpgraph.causal_mask``. The mask function is not consulted, as for every
    other model: the traced forward is one causal sequence with explicit positions (requests are
    separated by the compiled program's ``cu_seqlens_q``), so HF's packed-sequence term is moot."""
    config = kwargs.get("config")
    wants_tensor = kwargs.get("allow_is_causal_skip", True) is False and getattr(config, "index_topk", None)
    plain = kwargs.get("attention_mask") is None and not kwargs.get("q_offset") and not kwargs.get("kv_offset")
    if not (wants_tensor and plain):
        return None
    mask = torch.ops.dcpgraph.causal_mask(kwargs["batch_size"], kwargs["q_length"], kwargs["kv_length"],
                                          device=kwargs.get("device"))
    key = id(mask)
    _OWN_MASKS[key] = weakref.ref(mask, lambda _ref: _OWN_MASKS.pop(key, None))
    return mask


_registered = False
_callers: dict[int, int | None] | None = None


@contextlib.contextmanager
def recording_attention_callers() -> Iterator[dict[int, int | None]]:
    """While active, ``id(module) -> layer_idx`` of every module that calls the dcpgraph
    attention (how the front end checks that every decoder layer has one)."""
    global _callers
    previous, _callers = _callers, {}
    try:
        yield _callers
    finally:
        _callers = previous


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
