"""The collective registry (``dcpgraph.collectives``) and the pass-side builders that read it.

1. What a pass emits is what the verifier, the emulator and ``explain`` read back: the group kind
   and size, the exact result (against a by-hand loop over ranks), the display name.
2. An unknown group kind is refused before anything is inserted (it used to become the TP group).
3. Layering: ``dcpgraph.collectives`` depends on neither the passes nor the runtime, and the passes
   do not import the runtime.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch
import torch.fx

import dcpgraph
from dcpgraph.collectives import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    COLLECTIVES,
    DCP_GROUP,
    REDUCE_SCATTER,
    TP_GROUP,
    WAIT,
    collective_of,
)
from dcpgraph.mesh import Mesh
from dcpgraph.passes import collectives as coll
from dcpgraph.runtime import run_spmd

MESH = Mesh(4, 2)  # dcp groups {0,1} {2,3}; the tp group is the world
PACKAGE = Path(dcpgraph.__file__).resolve().parent
explain_module = importlib.import_module("dcpgraph.explain")  # ``dcpgraph.explain`` is the function


def _graph_of(build) -> tuple[torch.fx.GraphModule, torch.fx.Node]:
    """A GraphModule ``x -> build(graph, x)``; returns it and the node ``build`` returned."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    out = build(graph, x)
    graph.output(out)
    return torch.fx.GraphModule(torch.nn.Module(), graph), out


def _rank_input(rank: int) -> torch.Tensor:
    # Small integers in floats: every sum is exact whatever the order.
    return torch.arange(12, dtype=torch.float32).view(4, 3) + 100 * rank


# (builder over (graph, x), kind, size, by-hand result of rank r from all ranks' inputs)
def _gathered(inputs, group, rank):
    return torch.cat([inputs[m] for m in group], 0)


def _summed(inputs, group, rank):
    return sum(inputs[m] for m in group)


def _scattered(inputs, group, rank):
    return _summed(inputs, group, rank).chunk(len(group), 0)[group.index(rank)]


def _exchanged(inputs, group, rank):
    me = group.index(rank)
    return torch.stack([inputs[m][me] for m in group], 0)


EMITTERS = {
    "all_gather": (lambda g, x: coll.all_gather(g, x, 2, "dcp"), ALL_GATHER, "dcp", 2, _gathered),
    "reduce_scatter": (lambda g, x: coll.reduce_scatter(g, x, 4, "tp"), REDUCE_SCATTER, "tp", 4, _scattered),
    "all_reduce": (lambda g, x: coll.all_reduce(g, x, "dcp"), ALL_REDUCE, "dcp", None, _summed),
    "all_to_all": (lambda g, x: coll.all_to_all(g, x, 4, "tp"), ALL_TO_ALL, "tp", 4, _exchanged),
}


@pytest.mark.parametrize("name", list(EMITTERS))
def test_emitted_collective_reads_back_everywhere(name):
    build, entry, kind, size, by_hand = EMITTERS[name]
    gm, wait = _graph_of(build)
    assert wait.target is WAIT
    node = wait.args[0]
    assert node.target is entry.op and collective_of(node.target) is entry
    # the verifier's view: the kind, and group_size where the op has that parameter
    assert coll.collective_group(node) == (kind, size if entry.size_index is not None else None)
    # the node's arguments follow the entry's schema layout; the group name is last
    assert len(node.args) == len(entry.layout)
    assert node.args[entry.group_index] == (DCP_GROUP if kind == "dcp" else TP_GROUP)
    shown, _ = explain_module._op_name_and_args(node)
    assert shown.startswith(f"{entry.display}[{kind}")

    inputs = [_rank_input(r) for r in range(MESH.world_size)]
    outputs = run_spmd(gm, [(t,) for t in inputs], MESH)
    for rank, got in enumerate(outputs):
        want = by_hand(inputs, MESH.group(kind, rank), rank)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_registry_layouts_are_torch_schemas():
    assert len(COLLECTIVES) == len({c.name for c in COLLECTIVES}) == 4
    for c in COLLECTIVES:
        assert tuple(a.name for a in c.op._schema.arguments) == c.layout
        assert c.layout[c.group_index] == "group_name"
        if c.size_index is not None:
            assert c.layout[c.size_index] == "group_size"
        assert collective_of(c.op.overloadpacket) is c  # symbolic_trace graphs hold the packet
    assert collective_of(WAIT) is None and collective_of(torch.ops.aten.add.Tensor) is None


@pytest.mark.parametrize("name", list(EMITTERS))
def test_unknown_group_kind_is_refused_before_any_node(name):
    build = {
        "all_gather": lambda g, x: coll.all_gather(g, x, 2, "pp"),
        "reduce_scatter": lambda g, x: coll.reduce_scatter(g, x, 2, "world"),
        "all_reduce": lambda g, x: coll.all_reduce(g, x, "TP"),
        "all_to_all": lambda g, x: coll.all_to_all(g, x, 2, "dcp_group"),
    }[name]
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    with pytest.raises(ValueError, match=r"unknown group kind .*expected 'tp', 'dcp', 'pcp' or 'ep'"):
        build(graph, x)
    assert [n.op for n in graph.nodes] == ["placeholder"]


# -- layering --------------------------------------------------------------------------------------
def _dcpgraph_imports(path: Path) -> set[str]:
    """Absolute names of the dcpgraph modules a file imports (at any depth in the file)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m == "dcpgraph" or m.startswith("dcpgraph.")}


def test_collectives_package_depends_on_neither_passes_nor_runtime():
    allowed = {"dcpgraph.mesh", "dcpgraph.errors"}
    for path in sorted((PACKAGE / "collectives").glob("*.py")):
        outside = {m for m in _dcpgraph_imports(path) if not m.startswith("dcpgraph.collectives")}
        assert outside <= allowed, f"{path.name} imports {sorted(outside - allowed)}"


def test_passes_do_not_import_the_runtime():
    for path in sorted((PACKAGE / "passes").rglob("*.py")):
        runtime = {m for m in _dcpgraph_imports(path) if m.startswith("dcpgraph.runtime")}
        assert not runtime, f"passes/{path.relative_to(PACKAGE / 'passes')} imports {sorted(runtime)}"


def test_import_resolution_sees_relative_imports():
    # the checks above mean something only if relative imports resolve to absolute names
    assert "dcpgraph.collectives" in _dcpgraph_imports(PACKAGE / "passes" / "collectives.py")
    assert "dcpgraph.collectives.groups" in _dcpgraph_imports(PACKAGE / "runtime" / "distributed.py")
