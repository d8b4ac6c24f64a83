"""``comm="auto"`` picks the DCP lowering the decode-step cost model predicts cheapest, among the
lowerings valid for the program, and records why.

Proven by: the lowering actually built (its collectives and parameter rules, not only the recorded
name), HF ``generate`` on the same weights, refusals of ``ag`` where ``shard_dcp_replicated``
would raise (MLA, DSA, attention sinks), the choice flipping to ``a2a`` where the model predicts
``ag`` dearer (a link without latency; ``ag``'s whole projections of a 70B model on H200s) or where
``ag``'s weights would not fit next to the KV cache, and ``ag``'s priced weight bytes against the
bytes the compiled ``ag`` program really holds and the planner's ``weight_params_per_rank``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gqa_models import BLOCK_SIZE, MAX_BATCHED, PROMPTS, build_model

import dcpgraph
from dcpgraph.collectives import ALL_GATHER, ALL_TO_ALL
from dcpgraph.errors import UnsupportedModelError
from dcpgraph.mesh import Mesh
from dcpgraph.passes.collectives import collective_group
from dcpgraph.passes.graph_edit import nodes_calling
from dcpgraph.passes.pipeline import compile_program
from dcpgraph.passes.shard_dcp_auto import collective_backend
from dcpgraph.plan import load_model_shape
from dcpgraph.plan.comm_choice import CommWorkload, choose_comm, link_hardware
from dcpgraph.plan.hardware import PRESETS
from dcpgraph.program import REPLICATE, weight_bytes_per_rank
from dcpgraph.testing.generation import hf_greedy

MAX_NEW = 12


def _dcp_collectives(program, op) -> int:
    return sum(1 for n in nodes_calling(program.graph_module.graph, op) if collective_group(n)[0] == "dcp")


def _shard_dcp_summary(program) -> str:
    return next(p.summary for p in program.provenance if p.name == "shard_dcp")


@pytest.fixture(scope="module")
def llama():
    return build_model("llama")


@pytest.fixture(scope="module")
def traced(llama):
    return dcpgraph.trace(llama)


def test_auto_picks_ag_on_a_gloo_mesh_generates_hf_tokens_and_says_why(llama, traced):
    """The emulated tp=2 mesh stands in for two gloo ranks of this host: each collective costs
    ~120 us there, so ag (one collective per layer instead of three) is predicted cheaper and is
    the lowering actually built."""
    engine = dcpgraph.compile(traced, tp=2, dcp=2, block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_BATCHED)
    report = engine.report()
    assert report["comm"] == "ag" and report["comm_choice"].startswith("ag: cheapest predicted decode step")
    assert "a2a" in report["comm_choice"] and "ag_rs" in report["comm_choice"]  # every candidate priced
    program = engine.program
    layers = llama.config.num_hidden_layers
    # ag's structure: one DCP all-gather (the packed partials) per layer, no all-to-all, the
    # projections whole on both ranks (dcp == tp).
    assert _dcp_collectives(program, ALL_GATHER.op) == layers
    assert _dcp_collectives(program, ALL_TO_ALL.op) == 0
    rules = {s.target: s.shard for s in program.stage("fuse_mla_preprocess").inputs}  # before fuse_linears
    assert rules["model.layers.0.self_attn.q_proj.weight"] == REPLICATE
    got = engine.generate([list(p) for p in PROMPTS], MAX_NEW)
    assert got == [hf_greedy(llama, p, MAX_NEW) for p in PROMPTS]
    # The reason names every candidate with its predicted per-layer collective time, and shows in
    # the options explain prints and in shard_dcp's provenance.
    reason = program.lowering.comm_choice
    assert reason.startswith("ag: cheapest predicted decode step on host-gloo")
    priced = reason.split(", batch 8: ", 1)[1].split("; ")
    assert [p.split(" ", 1)[0] for p in priced] == ["a2a", "ag_rs", "ag"]
    assert all(" ms collectives per layer, " in p for p in priced)
    text = dcpgraph.explain(engine)
    assert f"comm_choice={reason}" in text
    assert f"comm=auto chose {reason}" in _shard_dcp_summary(program)


def test_explicit_comm_keeps_its_meaning_and_records_no_choice(traced):
    for comm in ("a2a", "ag_rs", "ag"):
        program = compile_program(traced, Mesh(2, 2), block_size=BLOCK_SIZE, comm=comm)
        assert program.lowering.comm == comm and program.lowering.comm_choice is None
    a2a = compile_program(traced, Mesh(2, 2), block_size=BLOCK_SIZE, comm="a2a")
    assert _dcp_collectives(a2a, ALL_TO_ALL.op) == traced.facts.num_layers


def test_the_choice_is_evaluated_at_half_max_model_len_and_the_batch_that_fits(traced):
    engine = dcpgraph.compile(traced, tp=2, dcp=2, block_size=BLOCK_SIZE, max_model_len=64, max_num_seqs=3)
    assert "at context 32, batch 3:" in engine.program.lowering.comm_choice
    # 8 blocks of 4 tokens per rank, 2 ranks: 64 tokens hold two requests of 32, not 3.
    small = dcpgraph.compile(traced, tp=2, dcp=2, block_size=BLOCK_SIZE, max_model_len=64, max_num_seqs=3,
                             num_blocks=8)
    assert "at context 32, batch 2:" in small.program.lowering.comm_choice


def _workload(**hardware) -> CommWorkload:
    return CommWorkload(dataclasses.replace(link_hardware("gloo"), **hardware), max_model_len=256, max_num_seqs=8)


def test_a_link_without_latency_makes_ag_dearer(traced):
    """With free collectives only ag's extra query/output projection bytes differ: a2a wins."""
    program = compile_program(traced, Mesh(2, 2), block_size=BLOCK_SIZE,
                              comm_workload=_workload(link_latency_s=0.0, link_bandwidth=1e15))
    assert program.lowering.comm == "a2a"
    assert _dcp_collectives(program, ALL_TO_ALL.op) == traced.facts.num_layers
    assert program.lowering.comm_choice.startswith("a2a: cheapest predicted decode step")


def test_ag_is_refused_when_its_weights_do_not_fit_next_to_the_kv_cache(traced):
    """Memory just big enough for a2a's weights and the KV cache: ag's replicated projections
    would not fit, so a2a is chosen on the same high-latency link where ag is otherwise cheaper."""
    a2a = compile_program(traced, Mesh(2, 2), block_size=BLOCK_SIZE, comm="a2a")
    weights = max(weight_bytes_per_rank(a2a))
    kv_budget = 1 << 16
    program = compile_program(traced, Mesh(2, 2), block_size=BLOCK_SIZE, comm_workload=CommWorkload(
        dataclasses.replace(link_hardware("gloo"), memory_bytes=weights + kv_budget + 1), max_model_len=256,
        max_num_seqs=8, cache_size=(("kv_cache_bytes_per_rank", kv_budget),)))
    reason = program.lowering.comm_choice
    assert program.lowering.comm == "a2a"
    assert "ag refused: weights" in reason and "exceed host-gloo's" in reason


def test_ags_priced_weight_bytes_are_what_the_ag_program_holds_and_what_the_planner_counts(llama, traced):
    a2a = compile_program(traced, Mesh(2, 2), block_size=BLOCK_SIZE, comm="a2a")
    ag = compile_program(traced, Mesh(2, 2), block_size=BLOCK_SIZE, comm="ag")
    auto = compile_program(traced, Mesh(2, 2), block_size=BLOCK_SIZE)
    held = {"a2a": max(weight_bytes_per_rank(a2a)), "ag": max(weight_bytes_per_rank(ag))}
    for comm, bytes_ in held.items():
        assert f"{comm} " in auto.lowering.comm_choice
        assert f"{bytes_ / 2**20:.2f} MiB weights per rank" in auto.lowering.comm_choice.split(f"{comm} ", 1)[1]
    shape = load_model_shape(llama.config)
    planner = (shape.weight_params_per_rank(2, dcp=2, comm="ag") - shape.weight_params_per_rank(2, dcp=2, comm="a2a"))
    assert held["ag"] - held["a2a"] == planner * llama.dtype.itemsize > 0


def test_a_70b_model_on_h200s_keeps_a2a_at_dcp_eq_tp():
    """At tp = dcp = 8 ag holds every query and output projection whole: 18 GB more per rank,
    read every step, against 10 us collectives. At dcp=2 of tp=8 the extra is a quarter of it."""
    shape = load_model_shape("llama-3.1-70b")
    hw = PRESETS["h200"]
    kv_per_token_layer = sum(c.bytes_per_token for c in shape.cache_shapes(8)) / shape.num_layers

    def choice(dcp):
        weights = {c: int(shape.weight_params_per_rank(8, dcp=dcp, comm=c) * 2) for c in ("a2a", "ag_rs", "ag")}
        return choose_comm(shape, hw, tp=8, dcp=dcp, context=65536, batch=16, kv_bytes_per_token_layer=kv_per_token_layer,
                           kv_bytes_per_rank=10**9, weight_bytes=weights, refused={})

    eight = choice(8)
    assert eight.comm == "a2a"
    priced = {c.comm: c for c in eight.candidates}
    assert priced["ag"].collective_s_per_layer(80) < priced["a2a"].collective_s_per_layer(80)  # fewer, yet dearer
    assert priced["ag"].cost.step_s > priced["a2a"].cost.step_s
    assert choice(2).comm == "ag"


def test_a_lowering_refused_after_pricing_hands_the_choice_to_the_next_cheapest():
    """What shard_dcp does when ag passed its checks but its rewritten graph fails verification
    (decode_scaling.py's shape on the host link, where ag is cheapest)."""
    shape = load_model_shape("llama-3.1-70b:hidden_size=256,num_hidden_layers=8,num_attention_heads=8,"
                             "num_key_value_heads=1,intermediate_size=512,vocab_size=512")
    weights = {c: int(shape.weight_params_per_rank(8, dcp=2, comm=c) * 2) for c in ("a2a", "ag_rs", "ag")}
    host = dataclasses.replace(link_hardware("gloo"), memory_bytes=1 << 40)
    first = choose_comm(shape, host, tp=8, dcp=2, context=1024, batch=4, kv_bytes_per_token_layer=4096,
                        kv_bytes_per_rank=0, weight_bytes=weights, refused={})
    assert first.comm == "ag"
    second = first.refuse("ag", "its lowering failed: shape propagation failed at %add")
    assert second.comm == "a2a" and "ag refused: its lowering failed: shape propagation failed" in second.reason
    assert second.reason.startswith("a2a: cheapest predicted decode step")


def test_mla_is_never_given_ag():
    from test_e2e_mla import build as build_mla

    program = compile_program(dcpgraph.trace(build_mla("deepseek_v3")), Mesh(2, 2), block_size=BLOCK_SIZE)
    assert program.lowering.comm == "a2a"
    assert "ag refused: comm='ag' lowers GQA attention only, this is mla" in program.lowering.comm_choice


def test_dsa_is_never_given_ag():
    from sfa_models import build as build_sfa

    program = compile_program(dcpgraph.trace(build_sfa()), Mesh(2, 2), block_size=4)
    assert program.lowering.comm == "a2a" and "ag refused" in program.lowering.comm_choice


def test_attention_sinks_refuse_ag_and_auto_builds_a2a_with_hf_tokens():
    """gpt-oss's per-head sink logits are TP-sharded between the projections: the ag lowering
    raises by name, so auto does not offer it and builds a2a."""
    from sliding_models import build, compile_options

    model = build("gpt_oss")
    with pytest.raises(UnsupportedModelError, match="sharded by"):
        dcpgraph.compile(model, tp=2, dcp=2, comm="ag", block_size=4, **compile_options("gpt_oss", 2))
    engine = dcpgraph.compile(model, tp=2, dcp=2, block_size=4, **compile_options("gpt_oss", 2))
    reason = engine.program.lowering.comm_choice
    assert engine.report()["comm"] == "a2a" and "ag refused: comm='ag'" in reason and "sharded by" in reason
    prompts = [list(range(5, 23)), [7, 3, 9]]
    assert engine.generate(prompts, 8) == [hf_greedy(model, p, 8) for p in prompts]


def test_the_link_follows_the_collective_backend():
    assert collective_backend(False, torch.device("cpu"), "eager") == "gloo"
    assert collective_backend(False, torch.device("cpu"), "torchair") == "hccl"
    assert collective_backend(False, torch.device("cuda", 0), "inductor") == "nccl"
    assert link_hardware("gloo").link_latency_s > 50e-6  # a host link: tens of microseconds and up
    assert link_hardware("nccl", device_name="NVIDIA H200").name == "h200"
    assert link_hardware("nccl", device_name="NVIDIA B200").name == "b200"
    assert "assumed" in link_hardware("nccl", device_name="Tesla T4").source
    assert link_hardware("hccl").name == "ascend-910b"
    with pytest.raises(ValueError, match="gloo"):
        link_hardware("mpi")


def _auto_rank(rank: int, world: int, measure: bool):
    import os

    os.environ["DCPGRAPH_MEASURE_LINKS"] = "1" if measure else "0"
    engine = dcpgraph.compile(build_model("llama"), tp=world, dcp=world, block_size=BLOCK_SIZE,
                              max_num_batched_tokens=MAX_BATCHED)
    return {"report": engine.report(), "tokens": engine.generate([list(p) for p in PROMPTS], MAX_NEW)}


@pytest.mark.gloo
@pytest.mark.slow
def test_gloo_ranks_price_with_the_links_they_measure_and_agree():
    """Under a real gloo world ``comm="auto"`` times ``all_gather`` and ``all_to_all`` between the
    ranks at start-up and prices with the slowest rank's figures: both ranks name the same
    measured link and choose the same lowering (a disagreement would build mismatched collectives
    and hang), the choice generates HF's tokens, and ``DCPGRAPH_MEASURE_LINKS=0`` prices the preset."""
    from dcpgraph.runtime.distributed import spawn

    llama = build_model("llama")
    reference = [hf_greedy(llama, p, MAX_NEW) for p in PROMPTS]
    measured = spawn(_auto_rank, 2, True, timeout_s=180)
    reasons = [r["report"]["comm_choice"] for r in measured]
    assert reasons[0] == reasons[1] and measured[0]["report"]["comm"] == measured[1]["report"]["comm"]
    assert "on host-gloo, measured at start-up (link " in reasons[0]
    latency_us = float(reasons[0].split("(link ", 1)[1].split(" us", 1)[0])
    assert latency_us > 0
    assert all(r["tokens"] == reference for r in measured)
    preset = spawn(_auto_rank, 2, False, timeout_s=180)
    expected = f"on host-gloo (link {link_hardware('gloo').link_latency_s * 1e6:.0f} us"
    assert all(expected in r["report"]["comm_choice"] for r in preset)
