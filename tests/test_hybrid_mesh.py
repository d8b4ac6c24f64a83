"""Hybrid models (qwen3_next, qwen3_5_text, lfm2) on TP and DCP meshes, emulated executor: the recurrent layers' heads/channels
split over TP by ``shard_recurrent_tp`` (state pools 1/tp per rank, row-parallel output), the
attention layers' KV sharded over DCP as for any model, and the recurrent ops reading the
request's global context length (so a first chunk starts from a zero state on every rank).

Exactness is against HF transformers' own greedy ``generate`` on the same weights: prompts
longer than the prefill chunk (8 tokens), a KV cache small enough to preempt at dcp <= 2 (the
preempted request restarts its state in a fresh slot). State bytes per rank are checked against
``memory_report`` and the layouts' formulas (``dcpgraph.recurrent_state``)."""

import pytest
import torch

import dcpgraph
import dcpgraph.memory as mem
from dcpgraph import Mesh
from dcpgraph.checkpoints.tensor_sources import InMemory, read_local
from dcpgraph.errors import UnsupportedModelError
from dcpgraph.passes.collectives import collective_group
from dcpgraph.passes.pipeline import compile_program, default_passes
from dcpgraph.passes.shard_recurrent_tp import shard_recurrent_tp
from dcpgraph.passes.tp_styles import SectionShardRule
from dcpgraph.program import PARAM, InputSpec, ShardRule
from dcpgraph.recurrent_state import GatedDeltaNetShape, ShortConvShape

transformers = pytest.importorskip("transformers")

from hybrid_mesh_checks import BLOCK, reaches, recurrent_tp_summary, run_on_mesh, shard_rules  # noqa: E402
from hybrid_models import MESH_MODELS, qwen3_next  # noqa: E402 - after the transformers check

# The MESH_MODELS' recurrent layers: qwen3_next's 3 gated delta nets (Hk 4, Hv 8, Dk = Dv = 8,
# K 4), lfm2's 2 short convolutions (C 32, K 3); fp32.
LAYERS = {"qwen3_next": (3, GatedDeltaNetShape(4, 8, 8, 8, 4)), "lfm2": (2, ShortConvShape(32, 3)),
          "qwen3_5": (3, GatedDeltaNetShape(4, 8, 8, 8, 4))}


def test_section_rule_keeps_each_sections_chunk():
    full = torch.arange(10 * 3).reshape(10, 3)  # sections of 2, 2 and 6 rows
    rule = SectionShardRule(0, sections=(2, 2, 6))
    assert rule.local(full, 1, 2).tolist() == torch.cat([full[1:2], full[3:4], full[7:10]]).tolist()
    assert rule.local_shape((10, 3), 2) == (5, 3) and rule.local(full, 0, 1) is full
    # a checkpoint loader reads only those rows, with the same result
    assert torch.equal(read_local(InMemory(full, "full"), rule, 1, 2), rule.local(full, 1, 2))
    with pytest.raises(ValueError, match=r"cannot split sections \[2, 2, 6\] over tp=4"):
        rule.local(full, 0, 4)


def test_recurrent_passes_sit_after_the_passes_they_resize():
    """insert_recurrent_state right after insert_kv_cache (it reads its step metadata),
    shard_recurrent_tp right after shard_tp (the mesh is set; it resizes the pools)."""
    names = [p.name for p in default_passes(Mesh(2, 2), block_size=4, comm="auto", recurrent=True)]
    assert names[names.index("insert_kv_cache") + 1] == "insert_recurrent_state"
    assert names[names.index("shard_tp") + 1] == "shard_recurrent_tp"
    assert "shard_recurrent_tp" not in [p.name for p in default_passes(Mesh(2, 2), block_size=4, comm="auto")]


@pytest.fixture(scope="module", params=["qwen3_next", pytest.param("lfm2", marks=pytest.mark.slow),
                                        pytest.param("qwen3_5", marks=pytest.mark.slow)])
def traced(request):
    model = MESH_MODELS[request.param]()
    return request.param, model, dcpgraph.trace(model)


@pytest.fixture(scope="module")
def compiled(traced):
    return compile_program(traced[2], Mesh(2, 2), block_size=BLOCK)


def test_tp_splits_recurrent_weights_outputs_and_pools_and_dcp_keeps_global_lengths(traced, compiled):
    arch, _, program = traced
    count, shape = LAYERS[arch]
    stateful = [n for n in compiled.graph_module.graph.nodes
                if n.target in (torch.ops.dcpgraph.causal_conv1d_.default, torch.ops.dcpgraph.gated_delta_rule_.default)]
    assert stateful and all("context_lens" in [a.name for a in n.all_input_nodes] for n in stateful)
    assert not any("local_context_lens" in [a.name for a in n.all_input_nodes] for n in stateful)
    local = shape.on_rank(2)
    want = {"conv_state": local.conv_state_shape(1)[1:]}
    if isinstance(shape, GatedDeltaNetShape):
        want["recurrent_state"] = local.recurrent_state_shape(1)[1:]
    assert {(p.role, p.shape) for p in compiled.recurrent_states} == set(want.items())
    rules = shard_rules(compiled)
    conv, sections = (("conv", None) if arch == "lfm2" else ("conv1d", (32, 32, 64)))
    module = "conv" if arch == "lfm2" else "linear_attn"
    if arch == "qwen3_5":  # the split layout's fused [q | k | v] projection, by section
        assert rules["model.layers.0.linear_attn.in_proj_qkv.weight"] == SectionShardRule(0, sections=sections)
    assert rules[f"model.layers.0.{module}.out_proj.weight"] == ShardRule(1)
    assert rules[f"model.layers.0.{module}.{conv}.weight"] == (SectionShardRule(0, sections=sections)
                                                               if sections else ShardRule(0))
    pool_bytes = sum(torch.Size(p.shape).numel() * p.dtype.itemsize for p in compiled.recurrent_states)
    assert pool_bytes == count * shape.state_bytes_per_request(torch.float32, tp=2)
    assert 2 * pool_bytes == count * shape.state_bytes_per_request(torch.float32)
    summary = recurrent_tp_summary(compiled)
    assert "split by heads/channels" in summary and "replicated" not in summary
    reduces = [n for n in compiled.graph_module.graph.nodes if (collective_group(n) or ("",))[0] == "tp"]
    outs = [n for n in compiled.graph_module.graph.nodes if n.op == "call_function"
            and any(a.op == "placeholder" and a.name.endswith(f"_{module}_out_proj_weight") for a in n.all_input_nodes)]
    assert len(outs) == count and all(reaches(out, reduces) for out in outs)  # row-parallel


def test_memory_fraction_sizing_subtracts_the_state_pools(traced, compiled, monkeypatch):
    """kv_bytes = F · M / ranks − weights − peak − max_num_seqs · state bytes per request (per rank)."""
    arch, _, _ = traced
    count, shape = LAYERS[arch]
    monkeypatch.setattr(mem, "device_memory", lambda device: mem.DeviceMemory(1 << 30, 1 << 30))
    sizing = mem.size_for_utilization(compiled.replace(lowering=compiled.lowering.decided(state_slots=16)), 0.5,
                                      "cuda:0", ranks=2, max_num_batched_tokens=8, max_num_seqs=16, max_model_len=64)
    state = 16 * count * shape.state_bytes_per_request(torch.float32, tp=2)
    assert sizing.recurrent_state_bytes == state > 0
    assert sizing.kv_bytes == (1 << 29) // 2 - sizing.weight_bytes - sizing.activation_peak_bytes - state
    assert sizing.num_blocks == sizing.kv_bytes // sizing.bytes_per_block
    assert "recurrent state" in sizing.describe()


@pytest.mark.slow  # ~15 s: two verified compiles
def test_state_bytes_per_rank_halve_at_tp2(traced):
    arch, _, program = traced
    count, shape = LAYERS[arch]
    reports = {tp: dcpgraph.compile(program, tp=tp, block_size=BLOCK, max_num_seqs=2).memory_report()
               for tp in (1, 2)}
    per_request = {tp: r["recurrent_state_bytes_per_request"] for tp, r in reports.items()}
    assert per_request[2] * 2 == per_request[1] == count * shape.state_bytes_per_request(torch.float32)
    assert per_request[2] == count * shape.state_bytes_per_request(torch.float32, tp=2)
    assert reports[2]["recurrent_state_bytes_per_rank"] == [2 * per_request[2]] * 2


@pytest.mark.slow  # 2-30 s a case by load (verified compile, HF generate, ~20 engine steps); 21 cases
@pytest.mark.parametrize("tp, dcp, interleave", [(2, 1, 1), (2, 2, 1), (2, 2, BLOCK), (4, 2, 1), (4, 2, BLOCK),
                                                 (4, 4, 1), (4, 4, BLOCK)])
def test_hybrid_gives_hf_greedy_tokens_on_meshes(traced, tp, dcp, interleave):
    _, model, program = traced
    run_on_mesh(model, program, tp, dcp, interleave)


@pytest.mark.slow  # ~45 s: its own trace, a verified compile, HF generate
def test_gated_delta_net_tp_does_not_divide_is_replicated():
    model = qwen3_next()  # 2 key heads, 2 KV heads: tp=4 replicates the gated delta nets and the KV heads
    program = dcpgraph.trace(model)
    engine = run_on_mesh(model, program, 4, 1)
    assert "layers [0, 1, 2] replicated" in recurrent_tp_summary(engine.program)
    full = 3 * GatedDeltaNetShape(2, 4, 8, 8, 4).state_bytes_per_request(torch.float32)
    assert engine.memory_report()["recurrent_state_bytes_per_request"] == full


@pytest.mark.slow  # ~10 s: a verified tp=1 compile
def test_a_recurrent_parameter_without_a_tp_rule_is_refused_by_name(traced):
    """A parameter under a recurrent module that its kind's rule does not name would be left
    replicated beside split neighbours: refused, naming it and the known suffixes."""
    arch, _, program = traced
    module = "conv" if arch == "lfm2" else "linear_attn"
    at_tp1 = compile_program(program, Mesh(1, 1), block_size=BLOCK)
    target = f"model.layers.0.{module}.extra_scale"
    widened = at_tp1.replace(mesh=Mesh(2, 1), state={**at_tp1.state, target: torch.ones(4)},
                             inputs=(*at_tp1.inputs, InputSpec("p_extra_scale", PARAM, target)))
    with pytest.raises(UnsupportedModelError, match=r"parameters \['extra_scale'\] under "
                                                    rf"model\.layers\.0\.{module}\. have no TP rule; known: \["):
        shard_recurrent_tp(widened)
