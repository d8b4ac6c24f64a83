"""DeepSeek sparse attention (DSA): the traced lightning indexer → ``dcpgraph.indexer_topk``.

The front end turns an attention call that carries the indexer's top-k (``indices=``) into
``dcpgraph.sparse_attention(q, k, v, indices, scale)``. The indices were computed by the model's
indexer, traced as plain ops; this module recognises that computation structurally, walking back
from the indices (HF layout, ``B = 1``)::

    w      = weights [B, S, Hi]                                  # any computation
    s      = matmul(q.to(f32) [B, S, Hi, D], kᵀ.to(f32).unsqueeze(1) [B, 1, D, T]) * scale
    scores = matmul(w.unsqueeze(-2), relu(s)).squeeze(-2)        # [B, S, T]
    scores = masked_fill(scores, ~causal_mask[:, 0], -inf)       # dcpgraph.causal_mask only
    idx    = topk(scores, min(K, T)).indices (.to(int32))

and replaces it by ``dcpgraph.indexer_topk(q, k, w, scale, K)`` (its tie rule:
:mod:`dcpgraph.ops.sparse_kernels`). Layers that reuse an earlier layer's top-k (GLM-5's
``"shared"`` indexer layers) read that layer's ``indexer_topk`` node. Anything else (another score function, a mask that is not
the front end's causal mask, a transposed key the walk cannot undo…) raises :class:`~dcpgraph.errors.UnsupportedModelError` naming the node and what differs.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ...passes.graph_edit import nodes_calling
from .nodes import example_value, refuse

aten = torch.ops.aten
dcp_ops = torch.ops.dcpgraph
_CASTS = (aten.to.dtype, aten._to_copy.default)
_MASK_VIEWS = (aten.select.int, aten.slice.Tensor, aten.squeeze.dim, aten.alias.default)


def _is(node: object, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _strip_casts(node: torch.fx.Node) -> torch.fx.Node:
    while _is(node, *_CASTS):
        node = node.args[0]
    return node


def _f32_source(node: object, at: torch.fx.Node, what: str) -> torch.fx.Node:
    """The tensor that ``node`` casts to fp32 (the indexer scores in fp32)."""
    if not _is(node, *_CASTS):
        raise refuse(at, f"indexer {what} is not cast to float32 before scoring (found {_name(node)})")
    val = example_value(node)
    if val is None or val.dtype != torch.float32:
        raise refuse(at, f"indexer {what} is scored in {getattr(val, 'dtype', None)}, not float32")
    return node.args[0]


def _name(node: object) -> str:
    if isinstance(node, torch.fx.Node):
        return f"{node.target}" if node.op == "call_function" else f"{node.op} {node.name}"
    return repr(node)


def _topk_constant(k: object, at: torch.fx.Node) -> int:
    """``K`` from ``topk``'s ``k``: an int, or ``sym_min(T, K)`` (HF's ``min(index_topk, T)``)."""
    if isinstance(k, int):
        return k
    if isinstance(k, torch.fx.Node) and k.op == "call_function" and getattr(k.target, "__name__", "") == "sym_min":
        ints = [a for a in k.args if isinstance(a, int)]
        if len(ints) == 1:
            return ints[0]
    raise refuse(at, f"indexer top-k count {_name(k)} is not a constant (or min(constant, tokens))")


def _causal_mask_source(mask: object) -> torch.fx.Node | None:
    node = mask
    while _is(node, *_MASK_VIEWS):
        node = node.args[0]
    return node if _is(node, dcp_ops.causal_mask.default) else None


def _unmask(scores: torch.fx.Node, at: torch.fx.Node) -> torch.fx.Node:
    """The scores before the causal mask; refuses any mask but ``~causal_mask`` filled with −inf."""
    if not _is(scores, aten.masked_fill.Scalar):
        raise refuse(at, f"indexer scores are not causally masked with masked_fill (found {_name(scores)})")
    x, hidden, fill = scores.args[:3]
    if fill != float("-inf"):
        raise refuse(at, f"indexer mask fills {fill!r}, not -inf")
    if not (_is(hidden, aten.bitwise_not.default, aten.logical_not.default) and _causal_mask_source(hidden.args[0])):
        raise refuse(at, "indexer mask is not the front end's causal mask (dcpgraph.causal_mask)")
    return x


def _weighted_relu_scores(x: torch.fx.Node, at: torch.fx.Node):
    """``(q, k, weights, scale)`` of ``squeeze(matmul(w.unsqueeze(-2), relu(s·scale)), -2)``."""
    if not (_is(x, aten.squeeze.dim) and x.args[1] in (-2, 2) and _is(x.args[0], aten.matmul.default)):
        raise refuse(at, f"indexer scores are not a per-head weighted sum (found {_name(x)})")
    w_row, per_head = x.args[0].args
    if not (_is(w_row, aten.unsqueeze.default) and w_row.args[1] in (-2, 2)):
        raise refuse(at, f"indexer head weights are not unsqueezed [B, S, 1, Hi] (found {_name(w_row)})")
    weights = w_row.args[0]
    if not _is(per_head, aten.relu.default):
        raise refuse(at, f"indexer per-head scores are not ReLU'd (found {_name(per_head)})")
    scaled = per_head.args[0]
    if not (_is(scaled, aten.mul.Tensor, aten.mul.Scalar) and isinstance(scaled.args[1], float)):
        raise refuse(at, f"indexer per-head scores are not scaled by a constant (found {_name(scaled)})")
    dots, scale = scaled.args
    if not _is(dots, aten.matmul.default):
        raise refuse(at, f"indexer per-head scores are not q·kᵀ (found {_name(dots)})")
    q = _f32_source(dots.args[0], at, "query")
    k_t = dots.args[1]
    if not (_is(k_t, aten.unsqueeze.default) and k_t.args[1] == 1):
        raise refuse(at, f"indexer key is not broadcast over heads (found {_name(k_t)})")
    k_t = _f32_source(k_t.args[0], at, "key")
    if not (_is(k_t, aten.transpose.int) and sorted(a % 3 for a in k_t.args[1:]) == [1, 2]):
        raise refuse(at, f"indexer key is not transposed [B, D, T] (found {_name(k_t)})")
    k = k_t.args[0]
    shapes = [example_value(n) for n in (q, k, weights)]
    if any(s is None for s in shapes) or (shapes[0].dim(), shapes[1].dim(), shapes[2].dim()) != (4, 3, 3):
        raise refuse(at, "indexer q/k/weights are not [B, S, Hi, D] / [B, T, D] / [B, S, Hi]")
    return q, k, weights, float(scale)


def recognise_indexers(graph: torch.fx.Graph) -> int:
    """Replace every sparse attention's traced indexer by ``dcpgraph.indexer_topk`` (in place on a
    graph the caller owns); returns how many. All are checked before any is replaced."""
    plans: dict[torch.fx.Node, tuple] = {}  # top-k node -> (first reader, q, k, w, scale, K)
    readers: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in nodes_calling(graph, dcp_ops.sparse_attention.default):
        indices = _strip_casts(node.args[3])
        if not (_is(indices, operator.getitem) and indices.args[1] == 1 and _is(indices.args[0], aten.topk.default)):
            raise refuse(node, f"sparse attention indices do not come from a top-k (found {_name(indices)})")
        topk = indices.args[0]
        readers.setdefault(topk, []).append(node)
        if topk in plans:  # a later layer reusing an earlier layer's selection (GLM-5's shared layers)
            continue
        k_arg = topk.args[1] if len(topk.args) > 1 else topk.kwargs.get("k")
        dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
        largest = topk.args[3] if len(topk.args) > 3 else topk.kwargs.get("largest", True)
        if dim not in (-1, 2) or not largest:
            raise refuse(node, f"indexer top-k over dim {dim} (largest={largest}), not the keys' largest")
        q, k, weights, scale = _weighted_relu_scores(_unmask(topk.args[0], node), node)
        plans[topk] = (node, q, k, weights, scale, _topk_constant(k_arg, node))
    for topk, (first, q, k, weights, scale, count) in plans.items():
        with graph.inserting_before(first):
            selected = graph.call_function(dcp_ops.indexer_topk.default, (q, k, weights, scale, count))
        for node in readers[topk]:
            node.args = (*node.args[:3], selected, *node.args[4:])
    return len(plans)


def check_sparse_canonical(graph: torch.fx.Graph) -> str | None:
    """Why ``graph``'s sparse attention is not canonical (None when it is): each one reads a
    ``dcpgraph.indexer_topk`` (its own, or an earlier layer's), and no ``dcpgraph.causal_mask``
    is left."""
    for node in nodes_calling(graph, dcp_ops.sparse_attention.default):
        if not _is(node.args[3], dcp_ops.indexer_topk.default):
            return f"{node.name}: sparse attention indices do not come from dcpgraph.indexer_topk"
    left = nodes_calling(graph, dcp_ops.causal_mask.default)
    if left:
        return f"dcpgraph.causal_mask left (read outside a recognised indexer): {[n.name for n in left]}"
    return None
