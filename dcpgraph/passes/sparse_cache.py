"""Cached form of DeepSeek sparse attention (DSA), emitted by ``insert_kv_cache`` per sparse layer.

The canonical ``sparse_attention(q, k, v, indexer_topk(iq, ik, w, iscale, K), scale)`` (latent
form after ``absorb_mla``: ``k = [c ‖ k_rope]`` one head, ``v = k[..., :R]``) becomes, token-major::

    kv_cache_write_(latent_cache, k, slot_mapping)        # as MLA
    kv_cache_write_(index_cache, ik, slot_mapping)        # the indexer's key, same slots
    vals, idx = paged_indexer_topk(iq, w, index_cache, block_table, cu_seqlens_q,
                                   kv_bound = position + 1, iscale, K)
    o, lse    = paged_sparse_attention(q, latent_cache, latent_cache[..., :R], block_table,
                                       cu_seqlens_q, idx, scale)

Both caches are paged with the same block table and slot mapping, so one virtual-block layout,
prefix caching and KV transfer cover both. Keys are read from the cache after this step's writes,
so context and new tokens are one key set, bounded per query by its position (``kv_bound``): the
top-k is taken over all of them at once, as the model's indexer does (no context/new split, and no
merge at dcp=1). ``shard_dcp`` shards the bound, the selection and the attention
(:mod:`dcpgraph.passes.shard_dcp_sparse`).
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedModelError, VerificationError
from .graph_edit import Emitter

aten = torch.ops.aten
dcp_ops = torch.ops.dcpgraph
INDEX_ROLE = "index_k"


def is_sparse(node: torch.fx.Node) -> bool:
    return node.target is dcp_ops.sparse_attention.default


def indexer_of(node: torch.fx.Node) -> torch.fx.Node:
    """The ``indexer_topk`` node a canonical sparse attention reads its indices from."""
    indexer = node.args[3]
    if not (isinstance(indexer, torch.fx.Node) and indexer.target is dcp_ops.indexer_topk.default):
        raise VerificationError(f"{node.name}: sparse attention indices must come from dcpgraph.indexer_topk")
    return indexer


def cache_names(layer: int, shares_selection: bool = False) -> list[str]:
    """A sparse layer's caches; a layer reusing an earlier layer's selection has no index cache."""
    return [f"latent_cache_{layer}"] if shares_selection else [f"latent_cache_{layer}", f"index_cache_{layer}"]


def position_bound(graph: torch.fx.Graph, e: Emitter, memo: dict):
    """``position + 1`` per token (how many keys of its request a query sees), emitted once."""
    if "bound" not in memo:
        positions = next((n for n in graph.nodes if n.op == "placeholder" and n.name == "position_ids"), None)
        if positions is None:
            raise VerificationError("sparse attention needs the 'position_ids' input, which the graph lacks")
        first = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first):
            memo["bound"] = e(aten.add.Tensor, e(aten.view.default, positions, [-1]), 1)
    return memo["bound"]


def emit_sparse_layer(graph: torch.fx.Graph, e: Emitter, node: torch.fx.Node, latent_cache, index_cache,
                      value_dim: int, meta: dict, memo: dict):
    """Emit the cached form of one canonical sparse ``node`` (insertion point: before ``node``);
    returns the node replacing its output ``[1, H, T, Dv]``. A layer whose ``indexer_topk`` an
    earlier layer already emitted (``index_cache`` None) reads that layer's selection."""
    if not value_dim:
        raise UnsupportedModelError(f"{node.name}: sparse attention is supported on MLA latents only "
                                    "(values a prefix of the key); run absorb_mla first")
    q, k, _v, _indexer, scale = node.args
    indexer = indexer_of(node)
    qt, kt = (e(aten.transpose.int, e(aten.select.int, x, 0, 0), 0, 1) for x in (q, k))  # [T, H, D]
    e(dcp_ops.kv_cache_write_.default, latent_cache, kt, meta["slot_mapping"])
    selections = memo.setdefault("selections", {})
    if index_cache is None:
        idx = selections[indexer]
    else:
        iq, ik, w, iscale, topk = indexer.args
        bound = position_bound(graph, e, memo)
        iqt = e(aten.select.int, iq, 0, 0)  # [T, Hi, Di]
        ikt = e(aten.unsqueeze.default, e(aten.select.int, ik, 0, 0), 1)  # [T, 1, Di]
        wt = e(aten.select.int, w, 0, 0)  # [T, Hi]
        e(dcp_ops.kv_cache_write_.default, index_cache, ikt, meta["slot_mapping"])
        _vals, idx = e.pair(dcp_ops.paged_indexer_topk.default, iqt, wt, index_cache, meta["block_table"],
                            meta["cu_seqlens_q"], bound, iscale, topk)
        selections[indexer] = idx
    v_cache = e(aten.slice.Tensor, latent_cache, -1, 0, value_dim)
    out, _lse = e.pair(dcp_ops.paged_sparse_attention.default, qt, latent_cache, v_cache, meta["block_table"],
                       meta["cu_seqlens_q"], idx, scale)
    return e(aten.unsqueeze.default, e(aten.transpose.int, out, 0, 1), 0)
