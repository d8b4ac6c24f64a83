"""Shape propagation after a pass runs only the nodes whose operation or input metadata changed
(:mod:`dcpgraph.passes.shape_keys`); the values it keeps must be the values a whole propagation
computes, through every pass of the pipeline, for GQA, MLA and MoE programs."""
from __future__ import annotations

import pytest
import torch

import dcpgraph
from dcpgraph.mesh import Mesh
from dcpgraph.models import build_model
from dcpgraph.passes.manager import program_pass, run_passes
from dcpgraph.passes.pipeline import compile_program
from dcpgraph.passes.shape_keys import value_signature
from dcpgraph.passes.verify import propagate_shapes
from dcpgraph.program import Program

aten = torch.ops.aten


def _signatures(program: Program) -> dict[str, object]:
    return {n.name: value_signature(n.meta["val"]) for n in program.graph_module.graph.nodes
            if n.op != "output" and "val" in n.meta}


def _whole_propagation(program: Program) -> dict[str, object]:
    for node in program.graph_module.graph.nodes:
        node.meta.pop("shape_key", None)
    ran = propagate_shapes(program)
    assert ran == len(program.graph_module.graph.nodes)
    return _signatures(program)


@pytest.fixture(scope="module")
def traced() -> Program:
    return dcpgraph.trace(build_model("llama", dtype=torch.float32, layers=1))


@pytest.mark.parametrize("arch,mesh", [("llama", Mesh(2, 2)), ("deepseek_v2", Mesh(2, 2)), ("qwen3", Mesh(4, 2)),
                                       ("qwen3_moe", Mesh(2, 1))])
def test_kept_values_equal_a_whole_propagation_through_the_pipeline(arch, mesh):
    program = compile_program(dcpgraph.trace(build_model(arch, dtype=torch.float32, layers=1)), mesh, block_size=4)
    kept = _signatures(program)
    assert kept == _whole_propagation(program)


@program_pass("copy_only")
def _copy_only(program: Program):
    return program.replace(graph_module=program.copy_graph()), "a copy"


def test_an_unchanged_graph_runs_only_its_inputs_attributes_and_output(traced):
    out = run_passes(traced, [_copy_only])
    always = [n for n in out.graph_module.graph.nodes if n.op in ("placeholder", "get_attr", "output")]
    assert propagate_shapes(out) == len(always) < len(out.graph_module.graph.nodes) // 2


@program_pass("relu_for_silu")
def _relu_for_silu(program: Program):
    gm = program.copy_graph()
    for node in gm.graph.nodes:
        if node.target is aten.silu.default:
            node.target = aten.relu.default  # the copied meta (value and key) stays on the node
    gm.recompile()
    return program.replace(graph_module=gm), "relu"


def test_a_changed_target_runs_again_and_so_does_a_replaced_value(traced):
    silu = next(n for n in traced.graph_module.graph.nodes if n.target is aten.silu.default)
    out = run_passes(traced, [_relu_for_silu])
    relu = next(n for n in out.graph_module.graph.nodes if n.name == silu.name)
    assert relu.target is aten.relu.default and relu.meta["shape_key"][0][1] is aten.relu.default
    assert relu.meta["val"] is not silu.meta["val"]
    # a value replaced by a pass (here: a wrong shape) is never kept, even under an equal key
    relu.meta["val"] = torch.empty(3, device="meta")
    propagate_shapes(out)
    assert tuple(relu.meta["val"].shape) == tuple(silu.meta["val"].shape)


@program_pass("narrow_a_weight")
def _narrow_a_weight(program: Program):
    """The gate projection's weight loses half its rows: everything downstream changes shape."""
    gm = program.copy_graph()
    silu = next(n for n in gm.graph.nodes if n.target is aten.silu.default)
    linear = silu.args[0]
    weight = linear.args[1]
    with gm.graph.inserting_before(linear):
        half = gm.graph.call_function(aten.slice.Tensor, (weight, 0, 0, weight.meta["val"].shape[0] // 2))
    linear.args = (linear.args[0], half, *linear.args[2:])
    up = next(n for n in silu.users if n.target is aten.mul.Tensor)
    other = next(a for a in up.args if a is not silu)
    with gm.graph.inserting_before(up):
        other_half = gm.graph.call_function(aten.slice.Tensor, (other, -1, 0, weight.meta["val"].shape[0] // 2))
    up.args = tuple(other_half if a is other else a for a in up.args)
    gm.recompile()
    return program.replace(graph_module=gm), "half"


def test_a_changed_input_shape_reaches_the_users_downstream(traced):
    from dcpgraph.errors import VerificationError

    silu = next(n for n in traced.graph_module.graph.nodes if n.target is aten.silu.default)
    # the down projection still expects the whole width: a whole propagation fails there, and so
    # must this one (the multiply's users are not kept with their old shapes)
    with pytest.raises(VerificationError, match="shape propagation failed at %"):
        run_passes(traced, [_narrow_a_weight])
    assert silu.meta["val"].shape[-1] > 0


def test_a_graph_with_an_in_place_metadata_change_is_propagated_whole():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(aten.clone.default, (x,))
    z = graph.call_function(aten.unsqueeze_.default, (y, 0))
    w = graph.call_function(aten.neg.default, (z,))
    graph.output(w)
    from dcpgraph.passes.shape_keys import mutates_metadata, node_key

    assert mutates_metadata(graph) and not mutates_metadata(torch.fx.Graph())
    assert node_key(z) is None  # a mutating operator always runs
