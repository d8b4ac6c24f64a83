"""The tiny DeepSeek-V4 through ``dcpgraph.compile(backend="torchair")`` at tp2·dcp2 (emulated),
with a sliding and a CSA layer (``tests/dsv4_models.py``).

A V4 program holds ops with no GE form (the open-window compressors, the indexer and the
attention over the compressed caches: per-request loops over lengths read on the host,
:mod:`dcpgraph.backends.npu.rules_compressed`), so the torchair backend must decide it eager
before compiling anything: the reason, naming those ops, is in ``Engine.report()`` and in
``dcpgraph.explain``'s provenance, and the eager program gives HF ``generate``'s greedy tokens.
On the same per-rank graph ``lower_npu(strict=False)`` (rules only; torchair is never imported
here) replaces exactly the ops that have a rule (the sliding layer's KV writes and its two merges, the
sink merge, the candidates' top-k merge) and names the rest: the compressed ops as having no rule, the
sliding layer's attention as refused by the FusedInferAttentionScore rules (a window with sinks
has no FIAS rule yet).

The one V4 rule GE would get in a V4 program, ``compressed_merge_sinks`` → aten, is converted on
its own: one spawned process loads torchair from the torch-npu wheel (``torchair_support``) and
compiles a graph of the op through the torchair backend in GE mode: every node must convert (GE
compile, a stand-in, then fails at the first call), the dump holds none of dcpgraph's ops, and
the lowered graph run on CPU equals the op.
"""

from __future__ import annotations

import sys
import time

import pytest
import sfa_models_path  # noqa: F401 - puts tests/ on sys.path for dsv4_models

pytestmark = [pytest.mark.torchair, pytest.mark.slow]  # the V4 export and compile: 50-80 s on 2 loaded cores

PROMPTS = [[9, 4, 77], [(5 * i + 1) % 131 for i in range(11)]]
NEW_TOKENS = 4
LAYERS = ["sliding_attention", "compressed_sparse_attention"]  # CSA holds all three kinds of V4 op
NO_RULE = ["dcpgraph.compress_windows_.default", "dcpgraph.compressed_attention_dcp_.default",
           "dcpgraph.compressed_topk_dcp_.default"]


@pytest.fixture(scope="module")
def v4_engine():
    import dsv4_models

    import dcpgraph

    start = time.perf_counter()
    model = dsv4_models.build(layer_types=LAYERS, num_hidden_layers=len(LAYERS), mlp_layer_types=["hash_moe", "moe"])
    program = dcpgraph.trace(model)
    engine = dcpgraph.compile(program, tp=2, dcp=2, block_size=4, max_num_batched_tokens=5, num_blocks=16,
                              backend="torchair")
    print(f"\nV4 traced and compiled in {time.perf_counter() - start:.1f} s")
    return model, engine


def test_v4_program_is_decided_eager_with_the_ops_named_and_gives_hf_tokens(v4_engine):
    import dcpgraph
    from dcpgraph.testing.generation import drain, hf_greedy

    model, engine = v4_engine
    report = engine.report()
    reason = report["eager_reason"]
    assert reason.startswith("torchair (GE) not used, the program runs eagerly: no GE lowering for ")
    assert all(op in reason for op in NO_RULE), reason
    assert report["backend"] == "torchair" and report["graphs"] == {}  # no graph was handed to torchair
    explained = dcpgraph.explain(engine)
    assert f"# backend (0.0 ms): {reason}" in explained.split("provenance:")[1]
    for prompt in PROMPTS:
        engine.add_request(prompt, max_new_tokens=NEW_TOKENS)
    got = drain(engine)
    assert [got[i] for i in range(len(PROMPTS))] == [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    assert "torchair" not in sys.modules  # the decision needs the rules table only


def test_lower_npu_of_the_v4_rank_graph_replaces_exactly_the_ops_with_rules(v4_engine):
    from dcpgraph.backends.npu import lower_npu
    from dcpgraph.backends.npu.decide import unlowered_ops

    _, engine = v4_engine
    gm = engine.program.graph_module
    before = {str(n.target) for n in gm.graph.nodes if getattr(n.target, "namespace", None) == "dcpgraph"}
    lowered = lower_npu(gm, strict=False)
    assert lowered.meta["lower_npu"] == {
        "kv_cache_write_->scatter_": 2, "merge_attention->aten": 2, "compressed_merge_sinks->aten": 1,
        "merge_topk->aten(topk)": 1}
    left = lowered.meta["lower_npu_left"]
    targets = sorted({why.split(":")[0] for why in left.values()})
    assert targets == sorted([*NO_RULE, "dcpgraph.paged_attention.default", "dcpgraph.partial_attention.default"])
    for why in left.values():
        if "attention_dcp_" in why or "compress" in why:
            assert why.endswith("no lowering rule"), why
        else:  # the sliding layer: FIAS rules exist, and refuse a sliding window (with sinks)
            assert "a sliding window or logit soft-cap is not lowered to FIAS" in why, why
    after = {str(n.target) for n in lowered.graph.nodes if getattr(n.target, "namespace", None) == "dcpgraph"}
    assert before - after == {"dcpgraph.kv_cache_write_.default", "dcpgraph.merge_attention.default",
                              "dcpgraph.compressed_merge_sinks.default", "dcpgraph.merge_topk.default"}
    assert unlowered_ops(lowered) == NO_RULE


# -- the sink merge through GE conversion (torchair from the wheel, one spawned process) -----------
def _merge_sinks_rank(rank: int, world: int, tier, dump: str):
    import torchair_support as ts

    ts.activate(tier)
    import torch

    from dcpgraph.backends.fallback import FallbackGraph
    from dcpgraph.backends.torchair import compile_torchair
    from dcpgraph.ops import compressed_dcp  # noqa: F401 - registers compressed_merge_sinks

    merge = torch.ops.dcpgraph.compressed_merge_sinks.default
    gen = torch.Generator().manual_seed(6)
    outs, lses, sinks = (torch.randn(2, 4, 3, 32, generator=gen), 3 * torch.randn(2, 4, 3, generator=gen),
                         torch.randn(4, generator=gen))
    lses[0, :, 1] = float("-inf")  # one rank empty for token 1; every rank for token 2, head 0
    lses[:, 0, 2] = float("-inf")
    outs[:, 0, 2] = 0.0
    gm = torch.fx.symbolic_trace(lambda o, s, k: merge(o, s, k))
    built = {}

    def factory(graph, example_inputs):
        built["graph"] = compile_torchair(graph, example_inputs, dump_dir=dump)
        return built["graph"]

    graph = FallbackGraph("merge_sinks", gm, factory, backend="torchair")
    want = merge(outs, lses, sinks)
    fell_back = graph(outs, lses, sinks)
    status = {k: v for k, v in graph.status.items() if k != "traceback"}
    lowered = built["graph"].lowered if "graph" in built else None
    return {
        "status": status, "traceback": graph.status.get("traceback", ""),
        "fallback_exact": bool(torch.equal(fell_back, want)),
        "lowered_diff": None if lowered is None else float((lowered(outs, lses, sinks) - want).abs().max()),
        "counts": None if lowered is None else dict(lowered.meta["lower_npu"]),
    }


def test_merge_sinks_rule_converts_to_ge(tmp_path):
    import collections

    import torchair_support as ts

    from dcpgraph.runtime.distributed import spawn

    tier = ts.prepare()
    if tier.skip_reason:
        pytest.skip(tier.skip_reason)
    dump = str(tmp_path / "merge_sinks")
    (result,) = spawn(_merge_sinks_rank, 1, tier, dump, timeout_s=300)
    assert result["status"]["fallback"].startswith("first call failed: GeUnavailableError"), (
        result["status"], result["traceback"][-2500:])
    assert result["fallback_exact"] and result["counts"] == {"compressed_merge_sinks->aten": 1}
    assert result["lowered_diff"] < 1e-6
    ops = collections.Counter(n["op"] for n in ts.read_ge_dump(dump))
    print(f"\nGE ops of the lowered sink merge: {dict(ops)}")
    assert ops["Sigmoid"] == 1 and ops["Exp"] >= 2 and ops["Log"] == 1, ops
    assert not [op for op in ops if "dcpgraph" in op.lower()], ops
