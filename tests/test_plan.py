"""The deployment planner (``dcpgraph.plan``): acceptance anchors, rules, rendering.

Independent checks: the published vLLM Kimi-K2 figures (70,272 B/token at tp=8; 715,072 tokens
= 11,173 blocks of 64); parameter counts against real HF models built from the same configs;
collective bytes against the closed forms written out by hand here; mesh validity against
``Mesh.validate`` itself. The check against compiled engines is in ``test_plan_engine.py``.
"""

from __future__ import annotations

import json
import math

import pytest

from dcpgraph import capacity
from dcpgraph.cli import main as dcpgraph_main
from dcpgraph.plan import dcp_collectives, load_model_shape, plan, render_table

KIMI_TOKENS_TP8 = 715_072
KIMI_BYTES_PER_TOKEN = 70_272  # 61 layers · (512 + 64) · 2 bytes
KIMI_BUDGET = KIMI_TOKENS_TP8 * KIMI_BYTES_PER_TOKEN  # = 11,173 blocks of 64 tokens per rank


def _kimi_plan(**kw):
    args = dict(world_size=8, hardware="h200", kv_cache_memory_bytes=KIMI_BUDGET, block_size=64,
                max_model_len=131072, weight_dtype_bytes=0.5)
    args.update(kw)
    return plan("kimi-k2", **args)


def _row(p, tp, dcp, comm=None):
    return next(r for r in p.rows if r.tp == tp and r.dcp == dcp and (comm is None or r.comm == comm))


@pytest.mark.parametrize("arch", ["kimi-k2", "deepseek-v3"])
def test_published_kimi_k2_capacity_anchor(arch):
    p = _kimi_plan() if arch == "kimi-k2" else plan(arch, world_size=8, hardware="h200", block_size=64,
                                                    kv_cache_memory_bytes=KIMI_BUDGET, max_model_len=131072,
                                                    weight_dtype_bytes=1)
    base = _row(p, 8, 1)
    assert base.kv_bytes_per_token == KIMI_BYTES_PER_TOKEN
    assert base.num_blocks == 11_173 and base.capacity_tokens == KIMI_TOKENS_TP8
    assert abs(base.kv_budget_bytes_per_rank / 2**30 - 46.8) < 0.05
    for dcp in (2, 4, 8):
        row = _row(p, 8, dcp)
        assert row.kv_bytes_per_token == KIMI_BYTES_PER_TOKEN / dcp
        assert row.capacity_tokens == KIMI_TOKENS_TP8 * dcp
    assert _row(p, 8, 8).capacity_tokens == 5_720_576
    assert _row(p, 8, 8).kv_bytes_per_token == 8_784


def test_invalid_dcp_listed_with_the_rule():
    p = _kimi_plan()
    for dcp in (3, 5, 6, 7):
        row = _row(p, 8, dcp)
        assert not row.valid and "tp % dcp == 0" in row.rule and "[1, 2, 4, 8]" in row.rule
    q = plan("qwen3-235b-a22b", world_size=8, hardware="h200", kv_cache_memory_bytes=20 << 30,
             max_model_len=32768, weight_dtype_bytes=1)
    assert [r.dcp for r in q.rows if r.tp == 8 and r.valid] == [1] + [2] * 6  # 2 interleaves x 3 comms
    bad = _row(q, 8, 4)
    assert not bad.valid and "(tp // num_kv_heads) % dcp == 0" in bad.rule
    assert "tp=4 <= num_kv_heads=4" in _row(q, 4, 2).rule


def test_recommendation_long_context_high_concurrency_uses_dcp():
    p = _kimi_plan(context_len=65536, concurrency=128)
    best = p.recommended
    assert best.dcp > 1, p.reason
    base = max((r for r in p.rows if r.fits and r.dcp == 1), key=lambda r: r.tokens_per_s)
    assert best.max_concurrency > base.max_concurrency and best.tokens_per_s > base.tokens_per_s
    assert f"{base.max_concurrency:,} sequences" in p.reason and "tok/s" in p.reason


def test_recommendation_short_context_low_concurrency_uses_dcp1():
    p = _kimi_plan(context_len=2048, concurrency=4)
    assert p.recommended.dcp == 1, p.reason
    assert "collectives add" in p.reason and "ms" in p.reason


def test_memory_utilisation_budget_and_weights_that_do_not_fit():
    p = plan("deepseek-v3", world_size=8, hardware="h200", gpu_memory_utilization=0.9, max_model_len=65536,
             weight_dtype_bytes=1)
    row = _row(p, 8, 1)
    assert row.kv_budget_bytes_per_rank == int(0.9 * 141e9) - row.weight_bytes_per_rank
    assert row.num_blocks == row.kv_budget_bytes_per_rank // (16 * KIMI_BYTES_PER_TOKEN)
    assert "no room for the KV cache" in _row(p, 1, 1).rule  # 671 GB of weights on one H200
    replicated = plan("deepseek-v3", world_size=8, hardware="h200", gpu_memory_utilization=0.9,
                      max_model_len=65536, weight_dtype_bytes=1, experts="replicated")
    assert not any(r.fits for r in replicated.rows) and replicated.recommended is None


def test_fp8_cache_models_scales():
    p = _kimi_plan(kv_cache_dtype="fp8_e4m3")
    # 576 fp8 elements + ceil(576 / 128) = 5 fp32 scales per token and layer
    assert _row(p, 8, 1).kv_bytes_per_token == 61 * (576 + 5 * 4)
    q = plan("llama-3.1-70b", world_size=8, hardware="b200", kv_cache_memory_bytes=1 << 30,
             max_model_len=8192, kv_cache_dtype="fp8_e4m3")
    assert _row(q, 8, 1).kv_bytes_per_token == 80 * 2 * (128 + 4)


def test_dsa_indexer_cache_counted():
    shape = load_model_shape("deepseek-v3.2")
    assert sum(c.bytes_per_token for c in shape.cache_shapes(8)) == 61 * (576 * 2 + 128 + 4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "deepseek_v2", "deepseek_v3"])
def test_weight_params_equal_the_hf_model(arch):
    from dcpgraph.models import build_model

    model = build_model(arch, dtype=__import__("torch").float32)
    shape = load_model_shape(model.config, dtype="float32")
    held = sum(p.numel() for p in model.parameters())
    held += sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert shape.weight_params_per_rank(1) == held
    assert shape.weight_bytes_per_rank(1) == 4 * held


def test_published_parameter_counts():
    assert round(load_model_shape("deepseek-v3").weight_params_per_rank(1) / 1e9) == 671
    assert round(load_model_shape("qwen3-235b-a22b").weight_params_per_rank(1) / 1e9) == 235
    assert round(load_model_shape("kimi-k2").weight_params_per_rank(1) / 1e12, 2) == 1.03


def test_collective_bytes_follow_shard_dcp():
    shape = load_model_shape("kimi-k2")  # 64 heads -> 8 per rank at tp=8; Dq 576, Dv 512
    n, t, h = 4, 3, 8
    a2a = dcp_collectives(shape, 8, n, "a2a", t)
    assert [c.bytes_per_rank for c in a2a] == [(n - 1) * t * h * 576 * 2, (n - 1) * t * h * 513 * 4]
    ag_rs = dcp_collectives(shape, 8, n, "ag_rs", t)
    assert [c.bytes_per_rank for c in ag_rs] == [(n - 1) * t * h * 576 * 2, (n - 1) * t * n * h * 4,
                                                 (n - 1) * t * h * 512 * 4]
    assert dcp_collectives(shape, 8, 1, "a2a", t) == []


def test_attention_time_is_kv_bytes_over_bandwidth_when_memory_bound():
    p = _kimi_plan(context_len=32768, concurrency=16)
    row = _row(p, 8, 1)
    read = row.batch * 32768 * KIMI_BYTES_PER_TOKEN  # every layer's KV of every request
    assert row.cost.attention_s == pytest.approx(read / 4.8e12, rel=1e-9)
    eight = _row(p, 8, 8, "a2a")
    assert eight.cost.collective_s > 0 and eight.cost.attention_s < row.cost.attention_s


def test_capacity_module_matches_closed_forms():
    caches = [capacity.CacheShape(1, 576, 2)] * 61
    assert capacity.bytes_per_block(caches, 64) == 64 * KIMI_BYTES_PER_TOKEN
    assert capacity.bytes_per_token(caches, 64, 8) == 8784
    assert capacity.blocks_for_bytes(KIMI_BUDGET, 64 * KIMI_BYTES_PER_TOKEN) == 11173
    assert capacity.max_sequences(11173, 32768, 64, 8) == 11173 // math.ceil(32768 / 512)
    assert capacity.blocks_for_bytes(5, 100) == 1  # at least one block, like the engine


def test_cli_table_and_json(capsys):
    argv = ["plan", "kimi-k2", "--world-size", "8", "--hardware", "h200", "--kv-cache-memory-bytes",
            str(KIMI_BUDGET), "--block-size", "64", "--max-model-len", "131072", "--context-len", "32768",
            "--concurrency", "64", "--weight-dtype-bytes", "0.5"]
    assert dcpgraph_main(argv) == 0
    out = capsys.readouterr().out
    assert "715,072" in out and "5,720,576" in out and "70,272" in out and "8,784" in out
    assert "INVALID: tp % dcp == 0 failed" in out and "recommendation: tp=8 dcp=" in out
    assert dcpgraph_main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = [r for r in data["rows"] if r["tp"] == 8 and r["valid"]]
    assert {r["dcp"]: r["capacity_tokens"] for r in rows} == {1: 715072, 2: 1430144, 4: 2860288, 8: 5720576}
    assert data["rows"][data["recommended"]]["dcp"] > 1


def test_cli_takes_vllms_fp8_spelling(capsys):
    argv = ["plan", "kimi-k2", "--world-size", "8", "--hardware", "h200", "--kv-cache-memory-bytes",
            str(KIMI_BUDGET), "--block-size", "64", "--max-model-len", "131072", "--json", "--kv-cache-dtype"]
    tables = []
    for spelling in ("fp8", "fp8_e4m3", "auto"):
        assert dcpgraph_main(argv + [spelling]) == 0
        tables.append(json.loads(capsys.readouterr().out)["rows"])
    assert tables[0] == tables[1] != tables[2]


def test_cli_errors_are_specific(capsys):
    assert dcpgraph_main(["plan", "no-such-model", "--world-size", "8", "--kv-cache-memory-bytes", "1",
                          "--max-model-len", "8"]) == 2
    assert "kimi-k2" in capsys.readouterr().err
    assert dcpgraph_main(["plan", "kimi-k2", "--world-size", "8", "--hardware", "tpu", "--kv-cache-memory-bytes",
                          "1", "--max-model-len", "8"]) == 2
    assert "h200" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # both budgets at once: argparse refuses
        dcpgraph_main(["plan", "kimi-k2", "--world-size", "8", "--kv-cache-memory-bytes", "1",
                       "--gpu-memory-utilization", "0.9", "--max-model-len", "8"])


def test_hf_config_directory(tmp_path):
    from dcpgraph.plan.architectures import ARCHITECTURES

    (tmp_path / "config.json").write_text(json.dumps(ARCHITECTURES["qwen3-235b-a22b"]))
    p = plan(str(tmp_path), world_size=8, hardware="ascend-910b", kv_cache_memory_bytes=8 << 30,
             max_model_len=32768, weight_dtype_bytes=1)
    assert _row(p, 8, 1).kv_bytes_per_token == 94 * 2 * 128 * 2  # one KV head per rank at tp=8
    assert _row(p, 8, 2).kv_bytes_per_token == 94 * 128 * 2
    assert "model " in render_table(p)


def test_overrides_of_a_named_architecture():
    shape = load_model_shape("deepseek-v3:num_hidden_layers=4,kv_lora_rank=256")
    assert shape.num_layers == 4 and shape.head_dim == 256 + 64
    with pytest.raises(ValueError, match="key=value"):
        load_model_shape("deepseek-v3:oops")


# -- the per-call overhead and cache terms, and the measured links ---------------------------------
def test_attention_cost_adds_the_overhead_and_reads_resident_working_sets_at_cache_bandwidth():
    from dataclasses import replace

    from dcpgraph.plan import PRESETS, Hardware
    from dcpgraph.plan.cost import attention_seconds

    hw = Hardware("cpu", 0, 10e9, 100e9, 1e9, 1e-4, compute_overlaps_memory=False, attention_overhead_s=2e-5,
                  cache_bytes=1 << 20, cache_bandwidth=40e9)
    small, large = 256 << 10, 4 << 20  # half the cache is 512 KiB
    assert attention_seconds(small, 1e6, hw) == pytest.approx(2e-5 + small / 40e9 + 1e6 / 100e9)
    assert attention_seconds(large, 1e6, hw) == pytest.approx(2e-5 + large / 10e9 + 1e6 / 100e9)
    # the working set decides residency: a small read in a step that touches more is a memory read
    assert attention_seconds(small, 0, hw, working_set_bytes=large) == pytest.approx(2e-5 + small / 10e9)
    off = replace(hw, attention_overhead_s=0.0, cache_bytes=0)
    assert attention_seconds(small, 0, off) == pytest.approx(small / 10e9)
    assert all(p.attention_overhead_s == 0 and p.cache_bytes == 0 for p in PRESETS.values())  # datasheets only


def test_private_cache_size_comes_from_the_machine():
    import os

    from dcpgraph.plan.calibration import private_cache_bytes

    size = private_cache_bytes()
    if os.path.isdir("/sys/devices/system/cpu/cpu0/cache"):
        assert size >= 16 << 10  # every x86/arm core has at least a 16 KiB private data cache
    else:
        assert size == 0


def _links(rank, world):
    from dcpgraph.plan import measure_links

    return measure_links(reps=5)


@pytest.mark.gloo
def test_measure_links_times_both_collectives_between_two_gloo_ranks():
    from dcpgraph.runtime.distributed import spawn

    for links in spawn(_links, 2, timeout_s=120):
        assert set(links) == {"all_gather", "all_to_all"}
        for latency, bandwidth in links.values():
            assert 0 < latency < 1.0 and 1e6 < bandwidth < 1e12


def _links_one_rank_late(rank, world):
    """measure_links with rank 1 leaving every barrier 50 ms after rank 0 (a skew far beyond a
    scheduler slice, so a timing that includes it cannot be mistaken for the link)."""
    import time

    import torch.distributed as dist

    from dcpgraph.plan import measure_links

    barrier = dist.barrier

    def late_barrier(*args, **kwargs):
        barrier(*args, **kwargs)
        if rank == 1:
            time.sleep(0.05)

    dist.barrier = late_barrier
    try:
        return measure_links(reps=3)
    finally:
        dist.barrier = barrier


@pytest.mark.gloo
def test_measure_links_times_the_link_not_the_ranks_skew_leaving_the_barrier():
    """Rank 0 would time rank 1's 50 ms lateness if its timed call followed the barrier."""
    from dcpgraph.runtime.distributed import spawn

    for links in spawn(_links_one_rank_late, 2, timeout_s=120):
        for name, (latency, _) in links.items():
            assert latency < 0.025, (name, latency)


# -- comm="ag": the replicated-query-projection lowering ------------------------------------------
def test_ag_collectives_and_allreduces_follow_shard_dcp_replicated():
    from dcpgraph.plan.cost import tp_allreduces_per_layer

    shape = load_model_shape("qwen3-235b-a22b")  # GQA: 64 query heads of 128
    n, t, h = 4, 3, 64 // 8
    [gather] = dcp_collectives(shape, 8, n, "ag", t)
    assert gather.bytes_per_rank == (n - 1) * t * n * h * (128 + 1) * 4  # [o ‖ lse] of the group's heads
    assert [tp_allreduces_per_layer(8, d, c) for d, c in ((1, "none"), (4, "a2a"), (4, "ag"), (8, "ag"))] == [2, 2, 2, 1]
    assert tp_allreduces_per_layer(1, 1, "ag") == 0


@pytest.mark.parametrize("tp,dcp", [(2, 2), (4, 2), (4, 4)])
def test_ag_weights_per_rank_equal_the_compiled_program(tp, dcp):
    """The planner's formula against what the compiled program holds per rank (tp_styles' count)."""
    import torch

    import dcpgraph
    from dcpgraph.models import build_model

    model = build_model("llama", dtype=torch.float32)  # 8 query heads, 1 KV head: dcp up to tp
    shape = load_model_shape(model.config, dtype="float32")
    buffers = 4 * sum(b.numel() for b in model.buffers())  # rotary tables: the program counts them
    for comm in ("a2a", "ag"):
        engine = dcpgraph.compile(model, tp=tp, dcp=dcp, comm=comm, block_size=16, num_blocks=8, max_model_len=64)
        held = engine.memory_report()["weight_bytes_per_rank"]
        assert set(held) == {4 * shape.weight_params_per_rank(tp, dcp=dcp, comm=comm) + buffers}, (comm, held)


def test_planner_offers_ag_for_gqa_only_and_picks_it_where_collectives_are_dear():


    gqa = plan("qwen3-235b-a22b", world_size=8, hardware="h200", gpu_memory_utilization=0.9, max_model_len=32768)
    assert {r.comm for r in gqa.rows if r.dcp > 1 and r.valid} == {"a2a", "ag_rs", "ag"}
    a2a, ag = _row(gqa, 8, 2, "a2a"), _row(gqa, 8, 2, "ag")
    assert ag.weight_bytes_per_rank > a2a.weight_bytes_per_rank  # dcp× q_proj, o_proj whole
    mla = _kimi_plan()
    assert "ag" not in {r.comm for r in mla.rows}
    # decode_scaling.py's model on a host link (1 ms per collective, as gloo on this loaded 2-core
    # machine): at tp=2, two fewer collectives per layer make ag the fastest dcp=2 lowering, and
    # at 128K it beats dcp=1 (the benchmark measured ag/dcp1 = 0.36-0.65 there).
    from dcpgraph.plan import Hardware

    host = Hardware("loaded-cpu", 24 << 30, 10e9, 50e9, 1e9, 1e-3, compute_overlaps_memory=False)
    spec = ("llama-3.1-70b:num_hidden_layers=8,hidden_size=256,intermediate_size=512,num_attention_heads=8,"
            "num_key_value_heads=1,head_dim=128,vocab_size=1000,torch_dtype=float32")
    p = plan(spec, world_size=2, hardware=host, kv_cache_memory_bytes=4 << 30, max_model_len=131072, concurrency=1)
    steps = {(r.dcp, r.comm): r.cost.step_s for r in p.rows if r.tp == 2 and r.interleave == 1 and r.cost}
    assert min(steps, key=steps.get) == (2, "ag"), steps
    assert steps[(2, "ag")] < 0.75 * steps[(1, "none")] and steps[(2, "a2a")] > steps[(2, "ag")] + 0.005


# -- nodes ------------------------------------------------------------------------------------------
def _two_nodes(**kw):
    return _kimi_plan(world_size=None, nnodes=2, gpus_per_node=8, context_len=8192, concurrency=64, **kw)


def test_two_nodes_tp16_pays_the_inter_node_link_and_tp8_dp2_does_not():
    """2 nodes x 8 H200: tp=16 spans both nodes, so its all-reduces run at the inter-node link
    (latency + one hop, 25 GB/s: the closed form written out here); tp=8 dp=2 keeps each replica in
    a node and costs exactly what the same layout costs on one node of 16."""
    two = _two_nodes()
    one = _kimi_plan(world_size=16, context_len=8192, concurrency=64)  # the same 16 devices in one node
    tp16, tp8 = _row(two, 16, 1), _row(two, 8, 1)
    assert (tp16.nodes, tp16.replicas, tp8.nodes, tp8.replicas) == (2, 1, 1, 2)
    hw, shape = two.hardware, two.model
    assert (hw.inter_node_bandwidth, hw.inter_node_latency_s) == (25e9, 10e-6)
    wire = 2 * 15 / 16 * tp16.batch * shape.hidden_size * shape.dtype_bytes
    per_layer = 2 * (hw.link_latency_s + hw.inter_node_latency_s + wire / hw.inter_node_bandwidth)
    assert tp16.cost.tp_allreduce_s == pytest.approx(shape.num_layers * per_layer)
    assert tp16.cost.tp_allreduce_s > 1.5 * _row(one, 16, 1).cost.tp_allreduce_s
    assert tp8.cost == _row(one, 8, 1).cost and tp8.tokens_per_s == _row(one, 8, 1).tokens_per_s
    # DCP groups of 8 consecutive ranks sit inside a node even when their TP group spans two
    assert _row(two, 16, 8, "a2a").cost.collective_s == _row(one, 16, 8, "a2a").cost.collective_s
    assert _row(two, 16, 8, "a2a").cost.tp_allreduce_s > _row(one, 16, 8, "a2a").cost.tp_allreduce_s


def test_the_table_shows_the_nodes(capsys):
    text = render_table(_two_nodes())
    assert "world 16 = 2 nodes x 8 h200" in text
    header = next(line for line in text.splitlines() if line.lstrip().startswith("tp"))
    assert " nodes " in header
    assert "inter-node link, 25 GB/s + 10 us per node hop" in text
    argv = ["plan", "kimi-k2", "--nnodes", "2", "--gpus-per-node", "8", "--kv-cache-memory-bytes", str(KIMI_BUDGET),
            "--block-size", "64", "--max-model-len", "131072", "--weight-dtype-bytes", "0.5", "--json"]
    assert dcpgraph_main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["world_size"], data["nnodes"], data["gpus_per_node"]) == (16, 2, 8)
    assert {(r["tp"], r["nodes"]) for r in data["rows"] if r["dcp"] == 1} == {(16, 2), (8, 1), (4, 1), (2, 1), (1, 1)}


def test_nodes_and_world_size_must_agree():
    from dcpgraph import ConfigError
    from dcpgraph.plan.hardware import nodes_spanned
    from dcpgraph.plan.planner import world_of

    assert world_of(None, 2, 8) == (16, 8) and world_of(16, 2, None) == (16, 8) and world_of(8, 1, None) == (8, 8)
    for bad in ((12, 2, 8), (15, 2, None), (None, 2, None)):
        with pytest.raises(ConfigError):
            world_of(*bad)
    assert nodes_spanned(4, 12, 6) == 2  # groups {0..3} {4..7} {8..11} on nodes of 6: the middle one is cut
    assert nodes_spanned(16, 32, 8) == 2 and nodes_spanned(8, 16, 8) == 1
