"""The pass manager: declared requirements, the always-on shape propagation, error context.

Model: ``build_model("llama")`` fp32, 1 layer (8 query heads of dim 8, 1 KV head).
"""

from __future__ import annotations

import re

import pytest
import torch

import dcpgraph
from dcpgraph.errors import PassOrderError, VerificationError
from dcpgraph.mesh import Mesh
from dcpgraph.models import build_model
from dcpgraph.passes.fuse_new_tokens import fuse_new_tokens
from dcpgraph.passes.insert_kv_cache import insert_kv_cache
from dcpgraph.passes.manager import ProgramPass, program_pass, run_passes
from dcpgraph.passes.pipeline import PIPELINE, compile_program, default_passes
from dcpgraph.passes.select_logits import select_logits
from dcpgraph.passes.shard_dcp import shard_dcp
from dcpgraph.passes.shard_tp import shard_tp
from dcpgraph.passes.verify import node_context
from dcpgraph.program import Program

aten = torch.ops.aten
FRONT_END_PASSES = ("trace", "canonicalize_attention")


@pytest.fixture(scope="module")
def traced() -> Program:
    return dcpgraph.trace(build_model("llama", dtype=torch.float32, layers=1))


# -- requirements -----------------------------------------------------------------------------------
def test_every_requirement_names_a_real_pass_and_the_pipeline_meets_them(traced):
    names = {p.name for p in PIPELINE} | set(FRONT_END_PASSES)
    for p in PIPELINE:
        assert p.requires, f"{p.name} declares no requirements"
        assert {r.stage for r in p.requires if r.stage} <= names, p.name
    program = compile_program(traced, Mesh(2, 2), block_size=4)
    assert program.passes_run() == [*FRONT_END_PASSES, *(p.name for p in PIPELINE)]


def _tp():
    return shard_tp.with_options(mesh=Mesh(2, 2))


MISORDERED = [
    ([_tp()], "pass 'shard_tp' requires 'insert_kv_cache' to have run",
     ["trace", "canonicalize_attention"]),
    ([insert_kv_cache, shard_dcp], "pass 'shard_dcp' requires 'shard_tp' to have run",
     ["trace", "canonicalize_attention", "insert_kv_cache"]),
    ([insert_kv_cache, _tp(), shard_dcp, fuse_new_tokens],
     "pass 'fuse_new_tokens' requires 'shard_dcp' not to have run yet",
     ["trace", "canonicalize_attention", "insert_kv_cache", "shard_tp", "shard_dcp"]),
    ([insert_kv_cache, _tp(), select_logits], "pass 'select_logits' requires 'shard_tp' not to have run yet",
     ["trace", "canonicalize_attention", "insert_kv_cache", "shard_tp"]),
]


@pytest.mark.parametrize(("passes", "message", "so_far"), MISORDERED, ids=[m[1].split("'")[1] for m in MISORDERED])
@pytest.mark.parametrize("verify", [True, False])
def test_misordered_pipeline_names_both_passes(traced, passes, message, so_far, verify):
    with pytest.raises(PassOrderError, match=message) as err:
        run_passes(traced, passes, verify=verify)
    assert str(err.value).endswith(f"; stages so far: {so_far}")


def test_a_requirement_is_checked_before_the_body_runs(traced):
    @program_pass("needs_cache", requires=["insert_kv_cache"])
    def needs_cache(program):
        raise AssertionError("the body ran although its requirement did not hold")

    with pytest.raises(PassOrderError, match="pass 'needs_cache' requires 'insert_kv_cache' to have run"):
        run_passes(traced, [needs_cache])


def test_reordered_default_pipeline_is_refused(traced):
    passes = default_passes(Mesh(2, 1), block_size=4, comm="auto")
    swapped = [passes[0], passes[1], passes[3], passes[2], *passes[4:]]  # shard_tp before select_logits
    with pytest.raises(PassOrderError, match="pass 'select_logits' requires 'shard_tp' not to have run yet"):
        run_passes(traced, swapped)


# -- the decorator ---------------------------------------------------------------------------------
def test_pass_object_carries_the_body_metadata():
    def body(program, factor: int = 1):
        """Scale nothing, by ``factor``."""
        return program, "nothing"

    p = program_pass("documented")(body)
    assert isinstance(p, ProgramPass)
    assert (p.__doc__, p.__name__, p.__wrapped__) == ("Scale nothing, by ``factor``.", "body", body)
    assert p.__module__ == __name__ and p.__qualname__.endswith("body")
    bound = p.with_options(factor=2)
    assert (bound.__doc__, bound.__wrapped__, bound.requires, bound.options) == (p.__doc__, body, p.requires, (("factor", 2),))
    assert insert_kv_cache.__wrapped__.__module__ == "dcpgraph.passes.insert_kv_cache"


# -- shape propagation always runs and always raises ----------------------------------------------
@program_pass("corrupt_view")
def _corrupt_view(program: Program):
    gm = program.copy_graph()
    node = next(n for n in gm.graph.nodes if n.target is aten.view.default and n.args[1][-1] == 8)
    node.args = (node.args[0], [*node.args[1][:-1], 7])
    gm.recompile()
    return program.replace(graph_module=gm), "view of 7 instead of 8"


@pytest.mark.parametrize("verify", [True, False])
def test_shape_propagation_failure_raises_with_context(traced, verify):
    with pytest.raises(VerificationError) as err:
        run_passes(traced, [_corrupt_view], verify=verify)
    text = str(err.value)
    head, *context = text.splitlines()
    assert head.startswith("after pass 'corrupt_view': shape propagation failed at %view: RuntimeError: shape")
    marked = [line for line in context if line.startswith(">> ")]
    assert len(marked) == 1 and re.fullmatch(r">> %view = aten.view\(%linear, \[1, %sym_size_int_\d+, -1, 7\]\)", marked[0])
    # (no shape on the failing line: propagation did not reach it, its old value is stale)
    at = context.index(marked[0])
    assert at == 3 and len(context) == 7  # three lines before, three after
    assert context[at - 1].startswith("   %linear = aten.linear(") and context[at - 1].endswith(": [1, 6, 64] float32")


def test_placeholders_must_match_specs_even_without_verify(traced):
    @program_pass("stray_input")
    def stray_input(program):
        gm = program.copy_graph()
        last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
        with gm.graph.inserting_after(last):
            gm.graph.placeholder("stray")
        gm.recompile()
        return program.replace(graph_module=gm), "a placeholder without an input spec"

    with pytest.raises(VerificationError, match=r"after pass 'stray_input': placeholders .*'stray'.* do not match"):
        run_passes(traced, [stray_input], verify=False)


def test_unverified_runs_still_leave_fresh_values(traced):
    """verify=False skips the checks, never the propagation later passes read."""
    program = compile_program(traced, Mesh(2, 1), block_size=4, verify=False)
    paged = [n for n in program.graph_module.graph.nodes if n.target is torch.ops.dcpgraph.paged_attention.default]
    assert [tuple(n.args[0].meta["val"].shape) for n in paged] == [(6, 4, 8)]  # rank 0's 4 of 8 heads


def test_node_context_clips_at_the_graph_ends():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(aten.neg.default, (x,))
    graph.output(y)
    n = y.name
    assert node_context(x).splitlines() == [">> %x = input", f"   %{n} = aten.neg(%x)", f"   return %{n}"]
    assert node_context(y.next, radius=1).splitlines() == [f"   %{n} = aten.neg(%x)", f">> return %{n}"]
