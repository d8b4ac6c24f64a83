"""``shard_dcp`` for DeepSeek-V4's compressed layers (:mod:`dcpgraph.ops.compressed_dcp`).

On rank ``r`` of a DCP group of ``N`` with interleave ``I``, per compressed layer::

    vals, g    = compressed_topk_dcp_(…, dcp_rank, …)        # CSA: local top-k, global entry indices
    selected   = merge_topk(all_gather(vals), all_gather(g), k)   # the dense top-k, on every rank
    q_all      = all_gather(q, heads)                          # [N·H, T, D]: the group's queries
    o_r, lse_r = compressed_attention_dcp_(q_all, …, selected)   # this rank's window tokens and entries
    out        = compressed_merge_sinks(all_to_all([o_r ‖ lse_r] by head block), sinks)

The compressors (``compress_windows_``) stay as they are: every rank carries the whole open
window and computes every entry; only the owner stores it. Every rank issues the same
collectives in the same order.
"""

from __future__ import annotations

import torch

from ..ops import compressed_dcp as _dcp_ops  # noqa: F401  (registers the DCP forms)
from ..ops.kernels import acc_dtype
from . import collectives as coll
from .graph_edit import Emitter, nodes_calling

aten = torch.ops.aten
dcp_ops = torch.ops.dcpgraph


def _replace(node, new) -> None:
    new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    node.replace_all_uses_with(new)
    node.graph.erase_node(node)


def shard_compressed(graph: torch.fx.Graph, e: Emitter, dcp_rank, n: int, interleave: int) -> int:
    """Rewrite every ``compressed_topk_`` and ``compressed_attention_`` of ``graph`` as above;
    returns how many attentions were rewritten."""
    for node in nodes_calling(graph, dcp_ops.compressed_topk_.default):
        iq, weights, keys, positions, cache, table, cu, context, scale, rate, topk, _ = node.args
        with graph.inserting_before(node):
            vals, glob = e.pair(dcp_ops.compressed_topk_dcp_.default, iq, weights, keys, positions, cache, table, cu,
                                context, dcp_rank, scale, rate, topk, n, interleave)
            all_vals = e(aten.view.default, coll.all_gather(graph, vals, n, "dcp"), [n, -1, topk])
            all_glob = e(aten.view.default, coll.all_gather(graph, glob, n, "dcp"), [n, -1, topk])
            selected = e(aten.unsqueeze.default, e(dcp_ops.merge_topk.default, all_vals, all_glob, topk), 0)
        _replace(node, selected)
    attentions = nodes_calling(graph, dcp_ops.compressed_attention_.default)
    for node in attentions:
        (q, kv, entries, positions, sinks, kv_cache, entry_cache, table, window_table, cu, context, scale, window,
         rate, selected, _) = node.args
        dtype = q.meta["val"].dtype
        acc = acc_dtype(dtype)
        dim = q.meta["val"].shape[-1]
        with graph.inserting_before(node):
            heads_first = e(aten.clone.default, e(aten.select.int, q, 0, 0), memory_format=torch.contiguous_format)
            q_all = coll.all_gather(graph, heads_first, n, "dcp")  # [N·H, T, D], group-rank order
            o, lse = e.pair(dcp_ops.compressed_attention_dcp_.default, q_all, kv, entries, positions, kv_cache,
                            entry_cache, table, window_table, cu, context, dcp_rank, scale, window, rate, selected,
                            n, interleave)
            o = o if dtype == acc else e(aten._to_copy.default, o, dtype=acc)
            packed = e(aten.cat.default, [e(aten.unflatten.int, o, 0, [n, -1]),
                                          e(aten.unsqueeze.default, e(aten.unflatten.int, lse, 0, [n, -1]), -1)], -1)
            received = coll.all_to_all(graph, packed, n, "dcp")  # row i: rank i's partial for my heads
            out = e(dcp_ops.compressed_merge_sinks.default, e(aten.slice.Tensor, received, -1, 0, dim),
                    e(aten.select.int, received, -1, dim), sinks)
            out = out if dtype == acc else e(aten._to_copy.default, out, dtype=dtype)
        _replace(node, out)
    return len(attentions)
