"""Which decoder layers dcpgraph can compile, decided from the config before anything is traced.

dcpgraph keeps one paged KV cache per attention layer and computes every other layer statelessly
from the current tokens. A layer that carries any other state across tokens (a Mamba/SSM scan, a
short convolution, linear attention) or whose attention pattern is not causal full/sliding/chunked
attention over that cache (compressed, or indexer-selected other than the
lightning indexer the sparse front end recognises) cannot be compiled by rewriting
attention alone: its decode steps would silently compute something else. Such models are refused
by name, from ``config.layer_types`` (transformers' ``ALLOWED_LAYER_TYPES`` vocabulary) and
``attention_chunk_size``, and, whatever the config says, by counting the attention ops of the
canonical graph, or when export itself fails the layers that called the attention
implementation (:func:`require_attention_in_every_layer`): fewer than one per decoder layer means
layers whose state dcpgraph would not cache.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import UnsupportedModelError

# Layer types compiled as they are: causal attention over the paged cache, or an MLP kind.
# ``indexed_attention`` (DeepSeek-V3.2, GLM-5) is compiled by the sparse-attention front end,
# which recognises the lightning indexer structurally and refuses other variants by name.
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention",
                                   "indexed_attention", "sparse", "dense"})

# Every other layer type transformers names, with the feature that makes it unsupported.
REFUSED_LAYER_TYPES: dict[str, str] = {
    "window_attention": "non-overlapping window attention",
    "deepseek_sparse_attention": "indexer-selected sparse attention",
    "qwen_sparse_attention": "indexer-selected sparse attention",
    "compressed_sparse_attention": "DeepSeek-V4 compressed attention (CSA/HCA)",
    "heavily_compressed_attention": "DeepSeek-V4 compressed attention (CSA/HCA)",
    "minimax_m3_sparse": ("block-sparse indexed attention (MiniMax-M3: each KV head keeps the top key blocks of "
                          "index_block_size keys plus its local blocks, not DeepSeek-V3.2's per-token top-k)"),
    "reference_sliding_attention": "ring-buffered reference sliding attention",
    "conv": "short-convolution layers (a recurrent state)",
    "linear_attention": "recurrent layers (Mamba/SSM, linear attention or gated delta net)",
    "mamba": "recurrent layers (Mamba/SSM, linear attention or gated delta net)",
    "hybrid": "hybrid Mamba/SSM + attention layers",
    "hybrid_sliding": "hybrid Mamba/SSM + attention layers",
    "moe": "attention-free MoE layers",
}

# What does run for a refused kind, appended to its refusal.
REFUSED_LAYER_HINTS: dict[str, str] = {
    kind: ("; a built (in-memory) model compiles at any tp dividing o_groups and dcp dividing tp (dcpgraph.compile; no prefix caching, "
           "speculative decoding or P/D) but a checkpoint directory is not loaded (its tensor names are not "
           "mapped); its exact DCP-sharded reference runs eagerly in dcpgraph.ops.compressed_attention and "
           "dcpgraph.ops.compressor, its per-rank bytes come from dcpgraph plan")
    for kind in ("compressed_sparse_attention", "heavily_compressed_attention")
}


def check_layer_types(text_config, recognised_recurrent: Iterable[int] = ()) -> None:
    """Raise :class:`UnsupportedModelError` naming the first unsupported feature in
    ``layer_types`` (or a chunked-attention size), before any tracing. Layers in
    ``recognised_recurrent`` hold a recurrent module the front end traces in canonical form
    (:mod:`.recurrent_layers`) and are not refused for their type."""
    skip = set(recognised_recurrent)
    types = list(getattr(text_config, "layer_types", None) or ())
    bad = [t for t in dict.fromkeys(t for i, t in enumerate(types) if i not in skip) if t not in SUPPORTED_LAYER_TYPES]
    if bad:
        kind = bad[0]
        what = REFUSED_LAYER_TYPES.get(kind, f"layer type {kind!r}")
        layers = [i for i, t in enumerate(types) if t == kind and i not in skip]
        raise UnsupportedModelError(
            f"{what}: not supported (layer_types {kind!r} at layers {layers[:8]}"
            f"{'…' if len(layers) > 8 else ''}); dcpgraph compiles layer types {sorted(SUPPORTED_LAYER_TYPES)}"
            f"{REFUSED_LAYER_HINTS.get(kind, '')}"
        )
    if "indexed_attention" in types and hasattr(text_config, "indexer_compress_ratio"):
        layers = [i for i, t in enumerate(types) if t == "indexed_attention"]
        raise UnsupportedModelError(
            f"compressed-block indexed attention (QSA): not supported (layer_types 'indexed_attention' at layers "
            f"{layers[:8]}{'…' if len(layers) > 8 else ''}): its indexer scores keys compressed "
            "indexer_compress_ratio:1 into blocks and keeps whole blocks within indexer_budget tokens, not "
            "DeepSeek-V3.2's lightning indexer (per-token top-k over every key), which dcpgraph compiles"
        )
    chunk = getattr(text_config, "attention_chunk_size", None)
    if chunk and "chunked_attention" not in types:
        raise UnsupportedModelError(
            f"chunked (block-local) attention without layer_types naming its chunked layers: not supported "
            f"(attention_chunk_size={chunk})"
        )


def require_attention_in_every_layer(num_layers: int, attention_layers: Iterable[int | None], model_name: str) -> None:
    """Raise unless there is an attention or a recognised recurrent layer for each of the
    ``num_layers`` decoder layers (``attention_layers``: the ``layer_idx`` of each, ``None`` where
    unknown; with any ``None`` only their number is compared)."""
    seen = list(attention_layers)
    indexed = {i for i in seen if i is not None}
    count = len(indexed) if len(indexed) == len(seen) else len(seen)
    if count >= num_layers:
        return
    missing = sorted(set(range(num_layers)) - indexed) if len(indexed) == len(seen) else []
    raise UnsupportedModelError(
        f"{model_name}: {num_layers - count} of {num_layers} decoder layers have no attention "
        f"dcpgraph recognises{_shown(missing)}: its attention is in a form dcpgraph cannot match "
        "(an additive bias such as ALiBi, hand-written masking) or it keeps a recurrent state "
        "(SSM, linear attention); neither would be cached correctly"
    )


def _shown(layers: list[int]) -> str:
    if not layers:
        return ""
    return f" (layers {layers[:8]}{'…' if len(layers) > 8 else ''})"
