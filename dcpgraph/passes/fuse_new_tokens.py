"""``fuse_new_tokens``: fold the new-token attention into the paged read.

``insert_kv_cache`` splits each attention into a paged read of the context and a causal attention
over the step's new tokens, merged by LSE. The writes come first in the graph, so by the read the
cache already holds the new tokens, and one paged read over ``context + new`` keys with a causal
bound by position gives the same result::

    o = paged_attention(q, k_cache, v_cache, table, cu_seqlens_q,
                        kv_lens = context_lens + (cu[1:] − cu[:-1]), kv_bound = position + 1)

That removes, per layer, the varlen attention, two stacks and the merge. The lengths and bounds
are global (positions); ``shard_dcp``, which runs next, turns them into each rank's local counts
(``layout.local_len``) as it does a window's start: a new token is written only to its owner's
shard, so under DCP each rank reads the new tokens it owns with the context it holds, and the
DCP merge that follows combines them with the rest. (Where the split was kept under DCP, every
rank recomputed the new-token attention over its heads and paid a second merge.) A sliding
window's ``kv_start`` and a soft-cap stay on the paged read (both are per query, by position); a
layer with attention sinks keeps a two-way merge of the fused read with its sink partial. Sparse
(DSA) layers have no split to fold: they read context and new tokens together through their
selection.
"""

from __future__ import annotations

import operator

import torch

from ..errors import UnsupportedModelError, VerificationError
from ..program import Program
from .graph_edit import Emitter, nodes_calling
from .insert_kv_cache import CHUNK_META
from .manager import not_yet_run, program_pass

aten = torch.ops.aten
dcp_ops = torch.ops.dcpgraph


def _ensures(program: Program) -> None:
    if program.lowering.new_tokens == "split":
        return
    left = nodes_calling(program.graph_module.graph, dcp_ops.partial_attention.default)
    if left:
        raise VerificationError(f"{left[0].name}: a layer still splits context and new-token attention")


@program_pass(
    "fuse_new_tokens",
    requires=[
        "insert_kv_cache",
        not_yet_run("shard_dcp", "it matches each paged read's own output in the two-way merge, before the "
                    "DCP merge stands between them, and shard_dcp makes its global counts local"),
    ],
    ensures=[_ensures],
)
def fuse_new_tokens(program: Program, enabled: bool = True):
    """``enabled=False`` (the Ascend backends, :data:`dcpgraph.backends.registry.SPLIT_NEW_TOKENS`)
    keeps the split: their paged attention reads a request's keys up to its length, no causal
    bound inside the cache."""
    if not enabled:
        chunked = [n for n in nodes_calling(program.graph_module.graph, dcp_ops.paged_attention.default)
                   if n.meta.get(CHUNK_META)]
        if chunked:
            raise UnsupportedModelError(
                f"chunked (block-local) attention (chunk {chunked[0].meta[CHUNK_META]}) needs the new tokens read "
                "with the context in one bounded paged read, which this backend does not provide "
                "(it keeps the context/new split); use a backend that fuses them (the CPU/CUDA ones)")
        return (program.replace(lowering=program.lowering.decided(new_tokens="split")),
                "kept the context/new split (the backend's paged attention takes no causal bound)")
    gm = program.copy_graph()
    graph = gm.graph
    e = Emitter(graph)
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    positions = placeholders["position_ids"]
    fused = 0
    seq_lens = bound = None
    for merge in nodes_calling(graph, dcp_ops.merge_attention.default):
        outs, lses = merge.args
        if outs.target is not aten.stack.default or lses.target is not aten.stack.default:
            continue
        o_ctx, o_new, *sink = outs.args[0]
        paged, partial = o_ctx.args[0], o_new.args[0]
        if paged.target is not dcp_ops.paged_attention.default or partial.target is not dcp_ops.partial_attention.default:
            continue
        if paged.args[6] is not None:
            continue
        if seq_lens is None:
            cu, ctx = paged.args[4], paged.args[5]
            with graph.inserting_before(paged):
                counts = e(aten.sub.Tensor, e(aten.slice.Tensor, cu, 0, 1), e(aten.slice.Tensor, cu, 0, 0, -1))
                seq_lens = e(aten.add.Tensor, ctx, counts)
                bound = e(aten.add.Tensor, e(aten.view.default, positions, [-1]), 1)
        paged.args = (*paged.args[:5], seq_lens, bound, *paged.args[7:])  # [7:]: scale, window start, softcap, fp8 scales
        if sink:
            lse_ctx, _lse_new, lse_sink = lses.args[0]
            outs.args = ([o_ctx, *sink],)
            lses.args = ([lse_ctx, lse_sink],)
        else:
            merged_out = [u for u in merge.users if u.target is operator.getitem and u.args[1] == 0]
            for u in merged_out:
                u.replace_all_uses_with(o_ctx)
        fused += 1
    graph.eliminate_dead_code()
    gm.recompile()
    return (program.replace(graph_module=gm, lowering=program.lowering.decided(new_tokens="fused")),
            f"{fused} layers read context and new tokens in one paged attention")
