"""Pass infrastructure: canonicalize_attention as a pass, the verifier catching broken passes,
purity, provenance and stage snapshots, and ``dcpgraph.explain``.

The pass (structure before/after, numbers unchanged), then the manager around it (a deliberately
broken pass is named by the verifier). The pattern rules themselves are tested in
tests/test_canonicalize.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dcpgraph
from dcpgraph.errors import VerificationError
from dcpgraph.frontends import canonicalize as canon
from dcpgraph.mesh import Mesh
from dcpgraph.passes.manager import program_pass, run_passes
from dcpgraph.passes.pipeline import compile_program, default_passes
from dcpgraph.passes.select_logits import select_logits
from dcpgraph.program import Program

VOCAB, HIDDEN, HEADS, KV_HEADS = 128, 64, 4, 2
aten = torch.ops.aten
ATTENTION = torch.ops.dcpgraph.attention.default


class Block(nn.Module):
    """Attention with ``-1`` head views (so TP sharding needs no shape fix-ups)."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode, self.hd = mode, HIDDEN // HEADS
        self.q = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k = nn.Linear(HIDDEN, KV_HEADS * self.hd, bias=False)
        self.v = nn.Linear(HIDDEN, KV_HEADS * self.hd, bias=False)
        self.o = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(64, 64, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.mode == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            rep = HEADS // KV_HEADS
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            s = q @ k.transpose(-2, -1) / math.sqrt(self.hd)
            o = torch.softmax(s.masked_fill(~self.tril[:t, :t], float("-inf")), -1) @ v
        return self.o(o.transpose(1, 2).reshape(b, t, -1))


class LM(nn.Module):
    tp_plan = {
        "layers.*.q": "colwise", "layers.*.k": "colwise", "layers.*.v": "colwise",
        "layers.*.o": "rowwise", "head": "colwise_gather_output",
    }

    def __init__(self, mode: str, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Block(mode) for _ in range(layers)])
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, position_ids):
        x = self.emb(input_ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


@pytest.fixture(scope="module")
def traced():
    """mode -> Program (stages: trace, canonicalize_attention)."""
    torch.manual_seed(0)
    return {mode: dcpgraph.trace(LM(mode).eval()) for mode in ("sdpa", "tril")}


@pytest.fixture(scope="module")
def compiled(traced):
    return compile_program(traced["tril"], Mesh(4, 2), block_size=8, comm="a2a")  # tests read a2a's structure


def run(program: Program, tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tokens)
    args = []
    for spec in program.inputs:
        if spec.kind == "user":
            args.append(torch.randint(0, VOCAB, (1, tokens), generator=gen) if spec.target == "input_ids"
                        else torch.arange(tokens).unsqueeze(0))
        else:
            args.append(program.state[spec.target])
    with torch.no_grad():
        out = program.graph_module(*args)
    return out[0] if isinstance(out, (tuple, list)) else out


def count(program: Program, target) -> int:
    return sum(1 for n in program.graph_module.graph.nodes if n.op == "call_function" and n.target is target)


# -- the pass -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sdpa", "tril"])
def test_canonicalize_keeps_the_numbers_and_replaces_the_ops(traced, mode):
    after = traced[mode]
    before = after.stage("trace")
    raw = aten.scaled_dot_product_attention.default if mode == "sdpa" else aten.softmax.int
    assert count(before, raw) == 2 and count(before, ATTENTION) == 0
    assert count(after, raw) == 0 and count(after, ATTENTION) == 2
    for tokens in (2, 7, 30):
        torch.testing.assert_close(run(after, tokens), run(before, tokens), atol=1e-5, rtol=1e-5)


def test_canonicalize_is_pure_and_drops_only_the_mask_buffers(traced):
    before = traced["tril"].stage("trace")
    text = str(before.graph_module.graph)
    vals = {n.name: n.meta.get("val") for n in before.graph_module.graph.nodes}
    after = canon.canonicalize_attention(before)
    assert str(before.graph_module.graph) == text
    assert {n.name: n.meta.get("val") for n in before.graph_module.graph.nodes} == vals
    dropped = {s.target for s in before.inputs} - {s.target for s in after.inputs}
    assert dropped == {"layers.0.tril", "layers.1.tril"}
    # idempotent: a canonical program has nothing left to rewrite
    again = canon.canonicalize_attention(after)
    assert str(again.graph_module.graph) == str(after.graph_module.graph)
    assert again.provenance[-1].summary.startswith("nothing to rewrite")


# -- the manager: broken passes are named ------------------------------------------------------------------
@program_pass("drop_attention_keep_users")
def _drop_attention_keep_users(program: Program):
    gm = program.copy_graph()
    node = next(n for n in gm.graph.nodes if n.target is ATTENTION)
    node._remove_from_list()  # gone from the graph, but its users still read it
    return program.replace(graph_module=gm), "deleted an attention"


@program_pass("corrupt_view")
def _corrupt_view(program: Program):
    gm = program.copy_graph()
    node = next(n for n in gm.graph.nodes if n.target is aten.view.default and n.args[1][-1] == 16)
    node.args = (node.args[0], [*node.args[1][:-1], 15])
    gm.recompile()
    return program.replace(graph_module=gm), "view of 15 instead of 16"


@program_pass("impure")
def _impure(program: Program):
    node = next(n for n in program.graph_module.graph.nodes if n.target is ATTENTION)
    node.args = (*node.args[:3], 1.0, node.args[4])  # edits the input program's graph
    return program, "changed a scale in place"


def _no_raw_attention(program: Program) -> None:
    left = canon.raw_attention(program.graph_module.graph)
    if left:
        raise VerificationError(f"raw attention left: {[n.name for n in left]}")


@program_pass("decanonicalize", ensures=[_no_raw_attention])
def _decanonicalize(program: Program):
    gm = program.copy_graph()
    for node in [n for n in gm.graph.nodes if n.target is ATTENTION]:
        q, k, v, scale, _ = node.args
        with gm.graph.inserting_before(node):
            sdpa = gm.graph.call_function(aten.scaled_dot_product_attention.default, (q, k, v),
                                          {"is_causal": True, "scale": scale, "enable_gqa": True})
        node.replace_all_uses_with(sdpa)
        gm.graph.erase_node(node)
    gm.recompile()
    return program.replace(graph_module=gm), "attention back to SDPA"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (_drop_attention_keep_users, r"after pass 'drop_attention_keep_users': graph lint failed"),
        (_corrupt_view, r"after pass 'corrupt_view': shape propagation failed"),
        (_impure, r"pass 'impure' mutated its input program"),
        (_decanonicalize, r"after pass 'decanonicalize': raw attention left"),
    ],
    ids=lambda x: getattr(x, "name", None) or "",
)
def test_verifier_names_the_broken_pass(traced, bad, message):
    program = traced["sdpa"]
    program = program.replace(graph_module=program.copy_graph())  # the impure pass edits this copy
    with pytest.raises(VerificationError, match=message):
        run_passes(program, [select_logits, bad])
    assert run_passes(program, [_decanonicalize], verify=False) is not None  # no check, no error


def test_the_configuration_chooses_the_optional_passes():
    """Expert parallelism, MTP's hidden states and the hybrid cache's tables are pipeline passes
    where the configuration asks for them: the first before shard_tp reads the plan, the second
    right after select_logits, the third last."""
    names = [p.name for p in default_passes(Mesh(2, 1), block_size=4, comm="auto")]
    assert not {"expert_parallel", "return_hidden_states", "layer_group_tables"} & set(names)
    every = [p.name for p in default_passes(Mesh(2, 1), block_size=4, comm="auto", expert_parallel_experts=True,
                                            return_hidden=True, windows=(8,))]
    assert every[0] == "expert_parallel" and every.index("expert_parallel") < every.index("shard_tp")
    assert every[every.index("select_logits") + 1] == "return_hidden_states"
    assert every[-1] == "layer_group_tables"
    assert [n for n in every if n in names] == names  # the rest in the default order


# -- provenance and stages -------------------------------------------------------------------------------
def test_every_pass_leaves_a_record_and_a_stage(compiled):
    expected = ["trace", "canonicalize_attention"] + [
        p.name for p in default_passes(Mesh(4, 2), block_size=8, comm="auto")
    ]
    assert [r.name for r in compiled.provenance] == expected
    assert [name for name, _ in compiled.stages] == expected
    assert all(r.seconds >= 0 and r.summary for r in compiled.provenance)
    for name, snapshot in compiled.stages:
        # each snapshot pairs its graph with the input specs of its time
        placeholders = [n.name for n in snapshot.graph_module.graph.nodes if n.op == "placeholder"]
        assert placeholders == [s.name for s in snapshot.inputs], name
        assert snapshot.stages == ()
    # native_linear moves the fp32 linears to dcpgraph.linear_f32 (where its kernel is built); the passes
    # after it find no bf16 RMSNorm or rotary chain in this model and keep its graph
    assert compiled.stage("native_linear").graph_module is compiled.graph_module
    assert not compiled.stage("trace").caches and len(compiled.stage("insert_kv_cache").caches) == 4
    assert compiled.stage("shard_tp").mesh == Mesh(4, 2) and compiled.stage("select_logits").mesh == Mesh(1, 1)
    with pytest.raises(KeyError, match="no stage 'optimize'"):
        compiled.stage("optimize")


# -- explain ------------------------------------------------------------------------------------------------
def test_explain_trace_stage(compiled):
    text = dcpgraph.explain(compiled, stage="trace")
    assert "# stage: trace" in text
    assert "dcpgraph.attention(" not in text and text.count("aten.softmax.int(") == 2
    assert "params: 10 tensors" in text and "buffers: 2 tensors" in text
    assert "user: %input_ids, %position_ids" in text
    assert "[1, s" in text  # the trace stage keeps export's symbolic token count
    canonical = dcpgraph.explain(compiled, stage="canonicalize_attention")
    assert canonical.count("= dcpgraph.attention(") == 2
    assert "aten.softmax" not in canonical and "buffers" not in canonical


def test_explain_final_program(compiled):
    text = dcpgraph.explain(compiled)
    lines = text.splitlines()
    assert lines[0].startswith("# LM: gqa attention, 2 layers, 4 q heads / 2 kv heads, head dim 16")
    assert "# mesh: Mesh(tp=4, dcp=2; dcp groups {0,1} {2,3})" in lines
    from dcpgraph.passes.pipeline import PIPELINE

    assert f"# stage: {compiled.stages[-1][0]}" in lines and compiled.stages[-1][0] == PIPELINE[-1].name
    assert "  caches (4):" in lines and any(line.strip().startswith("%k_cache_0: layer 0 k, [blocks, 8, 1, 16]") for line in lines)
    assert any("rank 0 holds" in line for line in lines if "params:" in line)
    assert "  rank: %tp_rank, %dcp_rank" in lines
    gathers = [line for line in lines if "= all_gather[dcp, 2](" in line]
    assert len(gathers) == 2 and all(line.endswith("float32") for line in gathers)
    assert text.count("= dcpgraph.paged_attention(") == 2
    assert any("= all_reduce[tp, sum](" in line for line in lines)
    assert any("= all_to_all[dcp, 2](" in line for line in lines)
    assert lines[lines.index("provenance:") + 1].startswith("  # trace (")
    for record in compiled.provenance:
        assert f"  {record}" in lines


def test_explain_all_stages_and_other_objects(compiled, traced):
    text = dcpgraph.explain(compiled, stage="all")
    stages = [line for line in text.splitlines() if line.startswith("# stage: ")]
    assert stages == [f"# stage: {name}" for name, _ in compiled.stages]
    with pytest.raises(KeyError, match="no stage"):
        dcpgraph.explain(compiled, stage="optimize")

    class EngineLike:
        program = compiled

    assert dcpgraph.explain(EngineLike()) == dcpgraph.explain(compiled)
    model = LM("sdpa", layers=1).eval()
    text = dcpgraph.explain(model)  # an nn.Module is traced first
    assert text.count("= dcpgraph.attention(") == 1 and "# stage: canonicalize_attention" in text
    with pytest.raises(TypeError, match="explain"):
        dcpgraph.explain(42)


def test_explain_fills_in_missing_shapes(traced):
    program = traced["sdpa"]
    bare = program.replace(graph_module=program.copy_graph(), stages=())
    for node in bare.graph_module.graph.nodes:
        node.meta.pop("val", None)
    text = dcpgraph.explain(bare)
    assert "# stage: final" in text
    attention = [line for line in text.splitlines() if "= dcpgraph.attention(" in line]
    assert attention and all(line.endswith(": [1, 4, 6, 16] float32") for line in attention)


def test_fuse_new_tokens_under_every_mesh_reads_local_counts_under_dcp():
    """One paged read per layer covers context and new tokens, with or without DCP; under DCP its
    key counts and causal bounds are this rank's (computed from ``dcp_rank``), never global."""
    from dcpgraph.models import build_model
    from dcpgraph.passes.pipeline import compile_program
    from dcpgraph.passes.shard_dcp import KV_BOUND, KV_LENS, _rank_local

    model = build_model("llama", dtype=torch.float64)
    ops_of = lambda p: [n.target for n in p.graph_module.graph.nodes if n.op == "call_function"]  # noqa: E731
    program = dcpgraph.trace(model)
    for mesh in (dcpgraph.Mesh(2, 1), dcpgraph.Mesh(2, 2)):
        for comm in ("a2a", "ag_rs", "ag"):
            fused = compile_program(program, mesh, block_size=4, comm=comm)
            ops = ops_of(fused)
            assert torch.ops.dcpgraph.partial_attention.default not in ops
            reads = [n for n in fused.graph_module.graph.nodes if n.target is torch.ops.dcpgraph.paged_attention.default]
            assert len(reads) == 2
            for read in reads:
                assert read.args[KV_BOUND] is not None
                assert all(_rank_local(read.args[i]) == (mesh.dcp > 1) for i in (KV_LENS, KV_BOUND))
            if mesh.dcp == 1:
                assert torch.ops.dcpgraph.merge_attention.default not in ops
                break
