"""``fuse_linears``: sibling linears → one linear over each rank's concatenated shards.

Checked against the unfused program (the default, the same pipeline otherwise) and against each
rank's own sibling shards, cut by hand from the full HF tensors.
"""

from __future__ import annotations

import torch

import dcpgraph
from dcpgraph import Mesh
from dcpgraph.checkpoints.loader import load_program
from dcpgraph.passes.fuse_linears import fuse_linears
from dcpgraph.passes.pipeline import compile_program
from dcpgraph.program import STATE_KINDS
from dcpgraph.testing.checkpoints import save_tiny_checkpoint, tiny_model
from dcpgraph.testing.generation import teacher_forced_logits

aten = torch.ops.aten


def _linears(program) -> int:
    names = ("aten.linear.default", "dcpgraph.linear_f32.default", "dcpgraph.linear_bf16.default")
    return sum(1 for n in program.graph_module.graph.nodes if n.op == "call_function" and str(n.target) in names)


def _summary(program, name: str) -> str:
    return next(p.summary for p in program.provenance if p.name == name)


def test_qkv_and_gate_up_fuse_with_biases_and_each_rank_holds_its_own_shards():
    """Qwen2 (q/k/v biases) at tp=2·dcp=2, where q is replicated and k/v split by head: each
    rank's fused weight and bias are its q, k, v (gate, up) shards stacked, in that order."""
    model = tiny_model("qwen2", layers=1)
    program = dcpgraph.trace(model)
    fused = compile_program(program, Mesh(2, 2), fuse_linears=True)
    plain = compile_program(program, Mesh(2, 2))
    assert _summary(fused, "fuse_linears") == "5 linears → 2 (1 groups of 2, 1 groups of 3)"
    assert _summary(plain, "fuse_linears") == "disabled"
    assert (_linears(fused), _linears(plain)) == (4 + 1, 7 + 1)
    params = dict(model.named_parameters())
    entries = [s for s in fused.inputs if s.target.startswith("cat(")]
    assert len(entries) == 3  # qkv weight, qkv bias, gate/up weight
    state_names = [s.target for s in fused.inputs if s.kind in STATE_KINDS]
    plain_names = [s.target for s in plain.inputs if s.kind in STATE_KINDS]
    for rank in fused.mesh.ranks:
        local = dict(zip(state_names, fused.local_state(rank)))
        theirs = dict(zip(plain_names, plain.local_state(rank)))
        for entry in entries:
            siblings = fused.sources[entry.target].inputs
            assert entry.target == f"cat({', '.join(siblings)})"
            want = torch.cat([theirs[t] for t in siblings], 0)
            assert torch.equal(local[entry.target], want), (rank, entry.target)
        tp_rank = fused.mesh.tp_rank(rank)
        k = params["model.layers.0.self_attn.k_proj.weight"]  # 1 KV head over 2 ranks: replicated
        q = params["model.layers.0.self_attn.q_proj.weight"]
        v = params["model.layers.0.self_attn.v_proj.weight"]
        qkv = local["cat(model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.k_proj.weight, "
                    "model.layers.0.self_attn.v_proj.weight)"]
        assert torch.equal(qkv, torch.cat([theirs["model.layers.0.self_attn.q_proj.weight"], k, v], 0))
        gate = params["model.layers.0.mlp.gate_proj.weight"].chunk(2, 0)[tp_rank]
        up = params["model.layers.0.mlp.up_proj.weight"].chunk(2, 0)[tp_rank]
        gate_up = local["cat(model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.up_proj.weight)"]
        assert torch.equal(gate_up, torch.cat([gate, up], 0))
        assert q.shape[0] == 64  # the replicated q rows come first, whole
    # the siblings' own entries left the program; the fingerprint-relevant code is deterministic
    assert not any(s.target == "model.layers.0.self_attn.q_proj.weight" for s in fused.inputs)
    assert fused.graph_module.code == compile_program(program, Mesh(2, 2), fuse_linears=True).graph_module.code


def test_logits_equal_the_unfused_program_and_off_keeps_seven_linears():
    """fp64 teacher-forced logits of the fused engine equal the unfused engine's (the same sums of
    the same products), at tp=2 (gate/up split, q/k/v by head)."""
    model = tiny_model("qwen3", layers=2, dtype=torch.float64)
    tokens = [5, 17, 99, 3, 42, 8]
    on = dcpgraph.compile(model, tp=2, executor="emulated", max_num_batched_tokens=1, fuse_linears=True)
    off = dcpgraph.compile(model, tp=2, executor="emulated", max_num_batched_tokens=1)
    assert _linears(on.program) == 4 * 2 + 1 and _linears(off.program) == 7 * 2 + 1
    a, b = teacher_forced_logits(on, tokens), teacher_forced_logits(off, tokens)
    assert float((a - b).abs().max()) <= 1e-12 * float(b.abs().max())


def test_disagreeing_siblings_stay_apart():
    """An input whose linears disagree (here one of q/k/v loses its bias) keeps all of them apart."""
    program = dcpgraph.trace(tiny_model("qwen2", layers=1))
    staged = compile_program(program, Mesh(1, 1), fuse_linears=False).stage("fuse_mla_preprocess")
    gm = staged.copy_graph()
    k_proj = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.linear.default
                  and n.args[1].name.endswith("k_proj_weight"))
    k_proj.args = k_proj.args[:2]
    gm.recompile()
    out, summary = fuse_linears.body(staged.replace(graph_module=gm))
    assert summary == "2 linears → 1 (1 groups of 2)"  # gate/up only
    assert any(s.target == "model.layers.0.self_attn.q_proj.weight" for s in out.inputs)


def test_checkpoint_reader_gives_each_rank_its_fused_rows(tmp_path):
    """From a checkpoint (meta state, rows read per rank) the fused entries equal the in-memory
    program's, rank by rank."""
    path = save_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    loaded = compile_program(load_program(path, "float32"), Mesh(2, 1), fuse_linears=True)
    memory = compile_program(dcpgraph.trace(tiny_model("qwen3")), Mesh(2, 1), fuse_linears=True)
    assert [s.target for s in loaded.inputs] == [s.target for s in memory.inputs]
    fused = [i for i, s in enumerate(s for s in loaded.inputs if s.kind in STATE_KINDS) if s.target.startswith("cat(")]
    assert fused
    for rank in range(2):
        got, want = loaded.local_state(rank), memory.local_state(rank)
        for i in fused:
            assert torch.equal(got[i], want[i]), rank
