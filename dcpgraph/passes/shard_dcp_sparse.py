"""``shard_dcp`` for DeepSeek sparse attention: a sharded indexer and an exact global top-k.

For each ``paged_indexer_topk`` on rank ``r`` of a DCP group of ``N`` with interleave ``I``::

    bound_r    = local_len(position + 1, r)                      # this rank's visible keys
    vals, j    = paged_indexer_topk(iq, w, local index cache, …, bound_r, K)   # local top-K
    g          = where(j >= 0, global_index(j, r), −1)           # (j // I)·N·I + r·I + j % I
    sel        = merge_topk(all_gather(vals), all_gather(g), K)  # [T, K] global, identical on all ranks
    mine       = where(sel >= 0 and owner(sel) == r, local_index(sel), −1)

and the ``paged_sparse_attention`` reading ``j`` reads ``mine`` instead (its query gathered over the
group and its ``(out, lse)`` merged like any context attention, in :mod:`.shard_dcp`).

Exactness: each rank's candidates are its own top-K under the tie rule (score desc, position asc;
positions within a rank are in global order, so local order agrees with global order), so the
global top-K is among the ``N·K`` gathered candidates and ``merge_topk`` picks it by the same rule
(:mod:`dcpgraph.ops.sparse_kernels`). Every rank then holds the same selection, attends over the
selected keys it owns (a rank may own none: ``(0, −inf)``), and the LSE merge of those partials is
attention over exactly the selected set. The indexer reads ``1/N`` of the keys per rank; the
gathers move ``N·T·K`` scores and positions, independent of context length.
"""

from __future__ import annotations

import torch

from . import collectives as coll
from .graph_edit import Emitter, getitem_users

aten = torch.ops.aten
dcp_ops = torch.ops.dcpgraph


def _emit_global_index(e: Emitter, local, rank, n: int, interleave: int):
    """``layout.global_index`` as graph ops; −1 stays −1."""
    blocks = e(aten.mul.Tensor, e(aten.div.Tensor_mode, local, interleave, rounding_mode="floor"), n * interleave)
    glob = e(aten.add.Tensor, e(aten.add.Tensor, blocks, e(aten.mul.Tensor, rank, interleave)),
             e(aten.remainder.Scalar, local, interleave))
    return e(aten.where.self, e(aten.ge.Scalar, local, 0), glob, e(aten.full_like.default, local, -1))


def _emit_owned_local(e: Emitter, glob, rank, n: int, interleave: int):
    """``local_index(g)`` where this rank owns global position ``g >= 0``, else −1."""
    owner = e(aten.remainder.Scalar, e(aten.div.Tensor_mode, glob, interleave, rounding_mode="floor"), n)
    local = e(aten.add.Tensor,
              e(aten.mul.Tensor, e(aten.div.Tensor_mode, glob, n * interleave, rounding_mode="floor"), interleave),
              e(aten.remainder.Scalar, glob, interleave))
    mine = e(aten.logical_and.default, e(aten.ge.Scalar, glob, 0), e(aten.eq.Tensor, owner, rank))
    return e(aten.where.self, mine, local, e(aten.full_like.default, glob, -1))


def shard_indexer(graph: torch.fx.Graph, e: Emitter, node: torch.fx.Node, dcp_rank, n: int, interleave: int,
                  local_len) -> None:
    """Rewrite one ``paged_indexer_topk`` ``node`` in place as above; ``local_len(e, L, rank)``
    emits ``layout.local_len``. Its index output's readers get this rank's owned local indices."""
    topk = node.args[7]
    with graph.inserting_before(node):
        node.args = (*node.args[:5], local_len(e, node.args[5], dcp_rank, n, interleave), *node.args[6:])
    users = getitem_users(node)
    if 0 not in users:
        with graph.inserting_after(node):
            users[0] = [e.getitem(node, 0)]
    values, local = users[0][0], users[1][0]
    anchor = max(values, local, key=lambda x: list(graph.nodes).index(x))
    readers = list(local.users)
    with graph.inserting_before(anchor.next):
        glob = _emit_global_index(e, local, dcp_rank, n, interleave)
        all_values = e(aten.view.default, coll.all_gather(graph, values, n, "dcp"), [n, -1, topk])
        all_glob = e(aten.view.default, coll.all_gather(graph, glob, n, "dcp"), [n, -1, topk])
        selected = e(dcp_ops.merge_topk.default, all_values, all_glob, topk)
        mine = _emit_owned_local(e, selected, dcp_rank, n, interleave)
    for reader in readers:
        reader.replace_input_with(local, mine)
