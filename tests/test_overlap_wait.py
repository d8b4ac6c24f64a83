"""``overlap_wait``: independent pure work moves between a collective and its wait, nothing else.

Checked on a hand-built graph (what moves, what stops the scan, the graph still valid) and on the
``a2a`` lowering of a real model, where this rank's counts of keys are computed while the first
query all-gather is in flight.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
from gqa_models import BLOCK_SIZE, build_model

import dcpgraph
from dcpgraph.collectives import ALL_GATHER, WAIT
from dcpgraph.passes.collectives import all_reduce, overlap_wait

aten = torch.ops.aten


def _graph():
    graph = torch.fx.Graph()
    x, cache, slots = graph.placeholder("x"), graph.placeholder("cache"), graph.placeholder("slots")
    wait = all_reduce(graph, x, "tp")
    dep = graph.call_function(aten.add.Tensor, (wait, 1.0))  # needs the collective's result
    free = graph.call_function(aten.mul.Tensor, (x, 2.0))  # does not: moves
    free2 = graph.call_function(aten.sin.default, (free,))  # depends only on a moved call: moves
    mixed = graph.call_function(aten.add.Tensor, (dep, free2))  # needs both: stays
    write = graph.call_function(torch.ops.dcpgraph.kv_cache_write_.default, (cache, free2, slots))  # in place
    after = graph.call_function(aten.cos.default, (x,))  # independent, but past the write: stays
    graph.output((mixed, after, write))
    return graph, wait, {"dep": dep, "free": free, "free2": free2, "mixed": mixed, "write": write, "after": after}


def test_moves_independent_pure_calls_before_the_wait_and_stops_at_a_write():
    graph, wait, n = _graph()
    assert overlap_wait(wait) == 2
    order = [node for node in graph.nodes if node.op == "call_function"]
    assert order.index(n["free"]) < order.index(n["free2"]) < order.index(wait) < order.index(n["dep"])
    assert order.index(n["write"]) < order.index(n["after"])
    assert order.index(wait.args[0]) < order.index(n["free"])  # still after the collective's launch
    graph.lint()
    assert overlap_wait(wait) == 0  # nothing left to move


def test_refuses_a_node_that_is_not_a_wait():
    graph, _, n = _graph()
    with pytest.raises(ValueError, match="not a wait_tensor"):
        overlap_wait(n["free"])


def test_a2a_lowering_computes_the_local_key_counts_during_the_query_gather():
    from dcpgraph.passes.shard_dcp import KV_BOUND, KV_LENS

    program = dcpgraph.compile(build_model("llama"), tp=2, dcp=2, comm="a2a", block_size=BLOCK_SIZE).program
    nodes = list(program.graph_module.graph.nodes)
    gathers = [x for x in nodes if x.op == "call_function" and x.target is ALL_GATHER.op]
    (wait,) = [u for u in gathers[0].users if u.target is WAIT]
    between = set(nodes[nodes.index(gathers[0]) + 1:nodes.index(wait)])
    reads = [x for x in nodes if x.target is torch.ops.dcpgraph.paged_attention.default]
    assert reads and all(read.args[i] in between for read in reads for i in (KV_LENS, KV_BOUND))
