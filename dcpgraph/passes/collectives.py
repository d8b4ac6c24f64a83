"""Functional collectives as graph nodes: what group a node uses, and builders for passes.

Graphs name groups logically (``dcpgraph.tp``, ``dcpgraph.dcp``; see
:mod:`dcpgraph.runtime.groups`), so one graph serves every rank.
"""

from __future__ import annotations

import torch
import torch.fx

from ..runtime.groups import DCP_GROUP, TP_GROUP, group_kind

c10d = torch.ops._c10d_functional

# op overload -> (index of group_name arg, index of group_size arg or None)
_GROUP_ARGS = {
    c10d.all_gather_into_tensor.default: (2, 1),
    c10d.reduce_scatter_tensor.default: (3, 2),
    c10d.all_reduce.default: (2, None),
    c10d.all_to_all_single.default: (3, None),
}
COLLECTIVES = frozenset(_GROUP_ARGS)


def collective_group(node: torch.fx.Node) -> tuple[str, int | None] | None:
    """``(kind, group_size or None)`` for a collective node, else None."""
    if node.op != "call_function" or node.target not in _GROUP_ARGS:
        return None
    name_index, size_index = _GROUP_ARGS[node.target]
    name = node.args[name_index] if len(node.args) > name_index else node.kwargs.get("group_name")
    size = node.args[size_index] if size_index is not None else None
    return group_kind(name), size


def _wait(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    return graph.call_function(c10d.wait_tensor.default, (node,))


def all_gather(graph: torch.fx.Graph, x: torch.fx.Node, size: int, kind: str = "dcp") -> torch.fx.Node:
    """Concatenate ``x`` from every rank of the group along dim 0, in group-rank order."""
    name = DCP_GROUP if kind == "dcp" else TP_GROUP
    return _wait(graph, graph.call_function(c10d.all_gather_into_tensor.default, (x, size, name)))


def reduce_scatter(graph: torch.fx.Graph, x: torch.fx.Node, size: int, kind: str = "dcp") -> torch.fx.Node:
    """Sum ``x`` over the group; rank ``i`` keeps chunk ``i`` of dim 0."""
    name = DCP_GROUP if kind == "dcp" else TP_GROUP
    return _wait(graph, graph.call_function(c10d.reduce_scatter_tensor.default, (x, "sum", size, name)))


def all_reduce(graph: torch.fx.Graph, x: torch.fx.Node, kind: str = "tp") -> torch.fx.Node:
    name = DCP_GROUP if kind == "dcp" else TP_GROUP
    return _wait(graph, graph.call_function(c10d.all_reduce.default, (x, "sum", name)))


def all_to_all(graph: torch.fx.Graph, x: torch.fx.Node, size: int, kind: str = "dcp") -> torch.fx.Node:
    """All-to-all of ``x`` shaped ``[size, ...]``: row ``j`` goes to group rank ``j``, and row ``i``
    of the result came from group rank ``i``. Split sizes are the constant ``[1]*size``, so the
    graph stays valid for any token count."""
    name = DCP_GROUP if kind == "dcp" else TP_GROUP
    splits = [1] * size
    return _wait(graph, graph.call_function(c10d.all_to_all_single.default, (x, splits, splits, name)))
