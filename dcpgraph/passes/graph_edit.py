"""Small helpers for passes that edit an FX graph they own (never the input Program's)."""

from __future__ import annotations

import operator

import torch
import torch.fx

aten = torch.ops.aten


class Emitter:
    """Emit ``call_function`` nodes at the current insertion point of ``graph``."""

    def __init__(self, graph: torch.fx.Graph):
        self.graph = graph

    def __call__(self, target, *args, **kwargs) -> torch.fx.Node:
        return self.graph.call_function(target, args, kwargs)

    def getitem(self, node: torch.fx.Node, index: int) -> torch.fx.Node:
        return self.graph.call_function(operator.getitem, (node, index))

    def pair(self, target, *args) -> tuple[torch.fx.Node, torch.fx.Node]:
        node = self(target, *args)
        return self.getitem(node, 0), self.getitem(node, 1)


def add_placeholders(graph: torch.fx.Graph, names: list[str]) -> list[torch.fx.Node]:
    """Append placeholders after the existing ones, in order; returns the new nodes."""
    existing = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = existing[-1] if existing else None
    nodes = []
    for name in names:
        if anchor is None:
            with graph.inserting_before(next(iter(graph.nodes), None)):
                node = graph.placeholder(name)
        else:
            with graph.inserting_after(anchor):
                node = graph.placeholder(name)
        if node.name != name:
            raise ValueError(f"placeholder name {name!r} is taken (got {node.name!r})")
        anchor = node
        nodes.append(node)
    return nodes


def nodes_calling(graph: torch.fx.Graph, target) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is target]


def context_reads(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The paged context reads (dense ``paged_attention`` and sparse ``paged_sparse_attention``),
    in graph order: what ``shard_dcp`` rewrites."""
    reads = (torch.ops.dcpgraph.paged_attention.default, torch.ops.dcpgraph.paged_sparse_attention.default)
    return [n for n in graph.nodes if n.op == "call_function" and n.target in reads]


def output_node(graph: torch.fx.Graph) -> torch.fx.Node:
    return next(n for n in reversed(graph.nodes) if n.op == "output")


def getitem_users(node: torch.fx.Node) -> dict[int, list[torch.fx.Node]]:
    users: dict[int, list[torch.fx.Node]] = {}
    for u in node.users:
        if u.op != "call_function" or u.target is not operator.getitem:
            raise ValueError(f"{node.name} is used by {u.name} other than through getitem")
        users.setdefault(u.args[1], []).append(u)
    return users


def replace_chains(graph: torch.fx.Graph, match, target) -> int:
    """Every node ``n`` for which ``match(n)`` gives ``(args, chain)`` (``chain``: the nodes the
    match covers, ``n`` last, each used only inside it) becomes ``target(*args)``, with ``n``'s
    meta; the chain is erased. Returns how many were replaced; the caller recompiles."""
    count = 0
    for node in list(graph.nodes):
        found = match(node)
        if found is None:
            continue
        args, chain = found
        with graph.inserting_before(node):
            fused = graph.call_function(target, tuple(args))
        fused.meta = dict(node.meta)
        node.replace_all_uses_with(fused)
        for dead in reversed(chain):
            graph.erase_node(dead)
        count += 1
    return count
