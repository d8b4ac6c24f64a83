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

With ``pcp > 1`` (:mod:`.split_pcp_prefill` gathered every step query onto every PCP rank) a DCP
group of ranks in attention order may hold the same heads: where ``dcp`` divides ``pcp`` its ranks
are PCP ranks of one TP rank, with the same queries, so ``q_all`` is the rank's own ``q`` and the
``[o ‖ lse]`` partials are all-gathered instead of exchanged by head block; where ``pcp`` divides
``dcp < …`` (``dcp > pcp``) member ``j = t·pcp + p`` holds TP rank ``t``'s heads, so one copy of each
head block is attended (``p = 0``'s) and each block's partial goes to its ``pcp`` holders. Either
way each rank attends its heads' queries once over its shard.
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


def shard_compressed(graph: torch.fx.Graph, e: Emitter, dcp_rank, n: int, interleave: int, pcp: int = 1) -> int:
    """Rewrite every ``compressed_topk_`` and ``compressed_attention_`` of ``graph`` as above
    (``pcp``: the mesh's, which decides whose heads the group's members hold); returns how many
    attentions were rewritten."""
    same_queries = pcp > 1 and pcp % n == 0
    copies = pcp if pcp > 1 and n > pcp and n % pcp == 0 else 1
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
            q_all = heads_first if same_queries else _distinct_blocks(
                e, coll.all_gather(graph, heads_first, n, "dcp"), n, copies)  # [blocks·H, T, D], group order
            o, lse = e.pair(dcp_ops.compressed_attention_dcp_.default, q_all, kv, entries, positions, kv_cache,
                            entry_cache, table, window_table, cu, context, dcp_rank, scale, window, rate, selected,
                            n, interleave)
            o = o if dtype == acc else e(aten._to_copy.default, o, dtype=acc)
            blocks = 1 if same_queries else n // copies
            packed = e(aten.cat.default, [e(aten.unflatten.int, o, 0, [blocks, -1]),
                                          e(aten.unsqueeze.default, e(aten.unflatten.int, lse, 0, [blocks, -1]), -1)],
                       -1)
            if same_queries:  # every member attended the same heads: gather the n partials
                received = coll.all_gather(graph, e(aten.squeeze.dim, packed, 0), n, "dcp")
                received = e(aten.unflatten.int, received, 0, [n, -1])
            else:
                if copies > 1:  # head block b goes to its copies holders b·copies .. (b+1)·copies - 1
                    packed = e(aten.flatten.using_ints, e(aten.expand.default, e(aten.unsqueeze.default, packed, 1),
                                                          [blocks, copies, -1, -1, -1]), 0, 1)
                    packed = e(aten.clone.default, packed, memory_format=torch.contiguous_format)
                received = coll.all_to_all(graph, packed, n, "dcp")  # row i: rank i's partial for my heads
            out = e(dcp_ops.compressed_merge_sinks.default, e(aten.slice.Tensor, received, -1, 0, dim),
                    e(aten.select.int, received, -1, dim), sinks)
            out = out if dtype == acc else e(aten._to_copy.default, out, dtype=dtype)
        _replace(node, out)
    return len(attentions)


def _distinct_blocks(e: Emitter, q_all, n: int, copies: int):
    """The group's gathered queries ``[N·H, T, D]`` with one copy of each head block: member
    ``j = t·copies + p`` holds block ``t``, so the ``p = 0`` copies, ``[N/copies·H, T, D]``."""
    if copies == 1:
        return q_all
    blocks = e(aten.unflatten.int, q_all, 0, [n // copies, copies, -1])
    return e(aten.flatten.using_ints, e(aten.clone.default, e(aten.select.int, blocks, 1, 0),
                                        memory_format=torch.contiguous_format), 0, 1)
