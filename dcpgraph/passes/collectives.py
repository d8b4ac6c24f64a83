"""Collectives as passes see them: builders that insert one, and the group a node uses.

Everything about each op (schema, arguments, semantics) lives in
:mod:`dcpgraph.collectives.registry`; these are its entries' :meth:`~dcpgraph.collectives.Collective.emit`
under the names passes use. Graphs name groups logically (``dcpgraph.tp``, ``dcpgraph.dcp``; see
:mod:`dcpgraph.collectives.groups`), so one graph serves every rank. ``kind`` is ``"tp"`` or
``"dcp"``; anything else raises ``ValueError`` before a node is inserted.

:func:`overlap_wait` moves independent work in between a collective and its ``wait_tensor``, so a
rank computes while the transfer (and the other ranks) catch up.
"""

from __future__ import annotations

import operator

import torch.fx

from ..collectives import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    REDUCE_SCATTER,
    WAIT,
    bind,
    collective_of,
    group_kind,
)


def collective_group(node: torch.fx.Node) -> tuple[str, int | None] | None:
    """``(kind, group_size or None)`` for a collective node, else None."""
    collective = collective_of(node.target) if node.op == "call_function" else None
    if collective is None:
        return None
    params = bind(collective.op, node.args, node.kwargs)
    size = params[collective.size_index] if collective.size_index is not None else None
    return group_kind(params[collective.group_index]), size


def all_gather(graph: torch.fx.Graph, x: torch.fx.Node, size: int, kind: str = "dcp") -> torch.fx.Node:
    """Concatenate ``x`` from every rank of the group along dim 0, in group-rank order."""
    return ALL_GATHER.emit(graph, x, size, kind)


def reduce_scatter(graph: torch.fx.Graph, x: torch.fx.Node, size: int, kind: str = "dcp") -> torch.fx.Node:
    """Sum ``x`` over the group; rank ``i`` keeps chunk ``i`` of dim 0."""
    return REDUCE_SCATTER.emit(graph, x, size, kind)


def all_reduce(graph: torch.fx.Graph, x: torch.fx.Node, kind: str = "tp") -> torch.fx.Node:
    """Sum ``x`` over the group; every rank gets the sum."""
    return ALL_REDUCE.emit(graph, x, None, kind)


def all_to_all(graph: torch.fx.Graph, x: torch.fx.Node, size: int, kind: str = "dcp") -> torch.fx.Node:
    """All-to-all of ``x`` shaped ``[size, ...]``: row ``j`` goes to group rank ``j``, and row ``i``
    of the result came from group rank ``i``. Split sizes are the constant ``[1]*size``, so the
    graph stays valid for any token count."""
    return ALL_TO_ALL.emit(graph, x, size, kind)


def _pure(node: torch.fx.Node) -> bool:
    """A call that neither mutates its inputs nor is a collective: safe to run earlier."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and not schema.is_mutable and collective_of(node.target) is None and node.target is not WAIT


def overlap_wait(wait: torch.fx.Node) -> int:
    """Move the calls after ``wait`` that do not depend on it to just before it; return how many.

    The scan stops at the first call that is not pure (a collective, another wait, an in-place
    write such as a cache write, the output): moving work across one of those could change what
    it reads or the order in which ranks issue collectives. Moved calls keep their relative
    order, and each one's inputs are defined before ``wait`` or are moved calls themselves, so
    the graph computes the same values; every rank runs the same graph, so they move alike.
    """
    if wait.target is not WAIT:
        raise ValueError(f"{wait.name} is not a wait_tensor")
    dependent, movable = {wait}, []
    earlier = set()
    for node in wait.graph.nodes:
        if node is wait:
            break
        earlier.add(node)
    node = wait.next
    while _pure(node):
        inputs = node.all_input_nodes
        if any(i in dependent for i in inputs) or not all(i in earlier for i in inputs):
            dependent.add(node)
        else:
            movable.append(node)
            earlier.add(node)
        node = node.next
    for node in movable:
        wait.prepend(node)
    return len(movable)
