"""Mamba-2 hybrids (bamba, nemotron_h, granitemoehybrid, falcon_h1) on TP and DCP meshes, emulated
executor: ``shard_recurrent_tp`` splits each mixer by whole heads and B/C groups (``in_proj`` by
its ``[z | x | B | C | dt]`` sections, the conv by ``[x | B | C]``, ``A_log``/``D``/``dt_bias`` by
head, the gated norm by group, ``out_proj`` row-parallel), state pools ``1/tp`` per rank; a mixer
whose groups ``tp`` does not divide is replicated.

Exactness is against HF transformers' own greedy ``generate`` (fp32, eager experts) on the same
weights, prompts longer than the prefill chunk (8 tokens), a KV cache small enough to preempt."""

import pytest
import torch

import dcpgraph
from dcpgraph import Mesh
from dcpgraph.passes.collectives import collective_group
from dcpgraph.passes.pipeline import compile_program
from dcpgraph.passes.tp_styles import SectionShardRule
from dcpgraph.program import ShardRule
from dcpgraph.recurrent_state import Mamba2Shape

transformers = pytest.importorskip("transformers")

from hybrid_mesh_checks import BLOCK, reaches, recurrent_tp_summary, run_on_mesh  # noqa: E402
from hybrid_models import MAMBA2_MESH_MODELS, bamba, falcon_h1  # noqa: E402 - after the transformers check

# Mamba-2 layers per model (and their module name); each 8 heads of 8, 4 groups of state 8, kernel 4.
LAYERS = {"bamba": (2, "mamba"), "nemotron_h": (1, "mixer"), "granitemoehybrid": (2, "mamba"),
          "falcon_h1": (2, "mamba")}
SHAPE = Mamba2Shape(8, 8, 4, 8, 4)


def test_tp_splits_mamba2_sections_heads_groups_and_pools():
    program = dcpgraph.trace(MAMBA2_MESH_MODELS["bamba"]())
    compiled = compile_program(program, Mesh(2, 2), block_size=BLOCK)
    rules = {s.target: s.shard for s in compiled.inputs}
    layer = "model.layers.0.mamba."
    assert rules[layer + "in_proj.weight"] == SectionShardRule(0, sections=(64, 64, 32, 32, 8))
    assert rules[layer + "conv1d.weight"] == SectionShardRule(0, sections=(64, 32, 32))
    assert all(rules[layer + name] == ShardRule(0) for name in ("A_log", "D", "dt_bias", "norm.weight"))
    assert rules[layer + "out_proj.weight"] == ShardRule(1)
    local = SHAPE.on_rank(2)
    assert {(p.role, p.shape) for p in compiled.recurrent_states} == {
        ("conv_state", local.conv_state_shape(1)[1:]), ("ssm_state", local.ssm_state_shape(1)[1:])}
    pool_bytes = sum(torch.Size(p.shape).numel() * p.dtype.itemsize for p in compiled.recurrent_states)
    assert pool_bytes == 2 * local.state_bytes_per_request(torch.float32)  # two mixers
    assert 2 * pool_bytes == 2 * SHAPE.state_bytes_per_request(torch.float32)  # 1/2 of tp=1
    summary = recurrent_tp_summary(compiled)
    assert "layers [0, 2] split by heads/channels" in summary and "replicated" not in summary
    scans = [n for n in compiled.graph_module.graph.nodes if n.target == torch.ops.dcpgraph.mamba2_scan_.default]
    assert [tuple(n.args[0].meta["val"].shape[1:]) for n in scans] == [(4, 8)] * 2  # x: 4 local heads of 8
    assert [tuple(n.args[3].meta["val"].shape[1:]) for n in scans] == [(2, 8)] * 2  # B: 2 local groups
    reduces = {n for n in compiled.graph_module.graph.nodes if (collective_group(n) or ("",))[0] == "tp"}
    outs = [n for n in compiled.graph_module.graph.nodes if n.op == "call_function"
            and any(a.op == "placeholder" and a.name.endswith("_mamba_out_proj_weight") for a in n.all_input_nodes)]
    assert len(outs) == 2 and all(reaches(out, reduces) for out in outs)  # row-parallel


@pytest.fixture(scope="module", params=list(MAMBA2_MESH_MODELS))
def traced(request):
    model = MAMBA2_MESH_MODELS[request.param]()
    return request.param, model, dcpgraph.trace(model)


@pytest.mark.slow  # ~5-15 s a case by load (verified compile, HF generate with its torch scan, ~20 steps); 12 cases
@pytest.mark.parametrize("tp, dcp", [(2, 1), (2, 2), (4, 2)])
def test_mamba2_hybrid_gives_hf_greedy_tokens_on_meshes(traced, tp, dcp):
    arch, model, program = traced
    engine = run_on_mesh(model, program, tp, dcp)
    count, _ = LAYERS[arch]
    report = engine.memory_report()
    assert report["recurrent_state_bytes_per_request"] == count * SHAPE.state_bytes_per_request(torch.float32, tp=tp)
    assert tp * report["recurrent_state_bytes_per_request"] == count * SHAPE.state_bytes_per_request(torch.float32)


@pytest.mark.slow  # ~15 s: its own trace, a verified compile, HF generate
def test_mamba2_groups_tp_does_not_divide_are_replicated():
    model = bamba(kv_heads=1, groups=2)  # 2 B/C groups: tp=4 replicates both mixers
    engine = run_on_mesh(model, dcpgraph.trace(model), 4, 2)
    assert "layers [0, 2] replicated" in recurrent_tp_summary(engine.program)
    full = 2 * Mamba2Shape(8, 8, 2, 8, 4).state_bytes_per_request(torch.float32)
    assert engine.memory_report()["recurrent_state_bytes_per_request"] == full


@pytest.mark.slow  # ~10 s: its own trace, a verified compile, HF generate
def test_falcon_h1_mup_vector_splits_with_in_proj_sections():
    """transformers' default multipliers make ``mup_vector`` all ones; distinct ones per
    ``[z | x | B | C | dt]`` section show each rank scales its own rows of each section."""
    model = falcon_h1(kv_heads=1, groups=4, ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 2.0])
    assert model.model.layers[0].mamba.mup_vector.unique().numel() == 5
    engine = run_on_mesh(model, dcpgraph.trace(model), 2, 2)
    rules = {s.target: s.shard for s in engine.program.inputs}
    assert rules["model.layers.0.mamba.mup_vector"] == SectionShardRule(2, sections=(64, 64, 32, 32, 8))


def test_a_recurrent_kind_without_a_tp_rule_stays_refused_off_tp1_dcp1():
    """Every kind traced today has a TP rule; one added without a row compiles at tp=1·dcp=1 only."""
    from types import SimpleNamespace

    from dcpgraph.errors import UnsupportedModelError
    from dcpgraph.passes.pipeline import refuse_recurrent_layers_on
    from dcpgraph.passes.shard_recurrent_tp import TP_RULES

    assert {"mamba2", "gated delta net", "short convolution"} <= set(TP_RULES)
    facts = SimpleNamespace(architecture="SomeHybrid", extra={"recurrent_layers": {0: "mamba2", 2: "new kind"}})
    program = SimpleNamespace(facts=facts)
    refuse_recurrent_layers_on(program, Mesh(1, 1))
    with pytest.raises(UnsupportedModelError, match=r"SomeHybrid: recurrent layers \(new kind at layers \[2\]\) "
                                                    r"compile at tp=1, dcp=1 only, got tp=2, dcp=1"):
        refuse_recurrent_layers_on(program, Mesh(2, 1))
