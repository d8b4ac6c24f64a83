"""``comm="ag"``: every rank computes its DCP group's query heads; one DCP collective per attention.

Proven against HF ``generate`` on the same weights (emulated ranks, and real gloo processes at
tp=dcp=2 and tp=4, dcp=2), against the ``a2a`` lowering's tokens, and by the graph's shape: per
layer one DCP all-gather (of packed partials) and no query gather; at ``dcp == tp`` no all-reduce
of the output projection and both projections whole on every rank, at ``dcp < tp`` the query
projection split by DCP group and the output projection still TP-sharded. Models it cannot lower
are refused with errors that name ``a2a``/``ag_rs``. The exchange
alone (``merge_all_heads``: all-gather of packed partials, merge of every head) is checked against
dense attention over all keys, from partials computed by hand per rank over interleaved key shards
(one shard empty), in the emulator and on gloo.
"""

from __future__ import annotations

import pytest
import torch
from gqa_models import BLOCK_SIZE, MAX_BATCHED, PROMPTS, build_model

import dcpgraph
from dcpgraph.collectives import ALL_GATHER, ALL_REDUCE
from dcpgraph.errors import UnsupportedModelError
from dcpgraph.passes.collectives import collective_group
from dcpgraph.passes.graph_edit import Emitter, nodes_calling
from dcpgraph.program import REPLICATE, ShardRule
from dcpgraph.runtime.distributed import spawn
from dcpgraph.testing.generation import hf_greedy

MAX_NEW = 16


def _collectives(program, op) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in nodes_calling(program.graph_module.graph, op):
        kind = collective_group(node)[0]
        counts[kind] = counts.get(kind, 0) + 1
    return counts


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return request.param, build_model(request.param)


def test_ag_generates_hf_tokens_with_one_gather_per_layer(model):
    name, m = model
    layers = m.config.num_hidden_layers
    engine = dcpgraph.compile(m, tp=2, dcp=2, comm="ag", block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_BATCHED)
    a2a = dcpgraph.compile(m, tp=2, dcp=2, comm="a2a", block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_BATCHED)
    got = engine.generate([list(p) for p in PROMPTS], MAX_NEW)
    assert got == [hf_greedy(m, p, MAX_NEW) for p in PROMPTS]
    assert got == a2a.generate([list(p) for p in PROMPTS], MAX_NEW)
    assert engine.report()["comm"] == "ag"
    program = engine.program
    # One DCP all-gather per layer (the packed partials); a2a has a query gather per layer too.
    assert _collectives(program, ALL_GATHER.op).get("dcp") == layers
    assert _collectives(a2a.program, ALL_GATHER.op).get("dcp") == layers
    # The attention's output all-reduce is gone: a2a reduces attention and MLP per layer.
    ag_reduces = _collectives(program, ALL_REDUCE.op).get("tp", 0)
    assert _collectives(a2a.program, ALL_REDUCE.op).get("tp", 0) - ag_reduces == layers
    program = program.stage("fuse_mla_preprocess")  # before fuse_linears stacks q/k/v
    rules = {s.target: s.shard for s in program.inputs}
    for layer in range(layers):
        prefix = f"model.layers.{layer}.self_attn."
        assert rules[prefix + "q_proj.weight"] == REPLICATE
        assert rules[prefix + "o_proj.weight"] == REPLICATE
        assert rules[prefix + "k_proj.weight"] == ShardRule(0, 1)  # the one KV head, as under a2a
        if name == "qwen2":  # q_proj has a bias: replicated with its weight
            assert rules[prefix + "q_proj.bias"] == REPLICATE
    state = program.local_state(1)
    full = dict(m.named_parameters())
    q_index = next(i for i, s in enumerate(s for s in program.inputs if s.kind == "param")
                   if s.target == "model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(state[q_index], full["model.layers.0.self_attn.q_proj.weight"])


def test_ag_with_sliding_windows_and_softcap_generates_hf_tokens():
    from sliding_models import build

    model = build("gemma2")  # alternating sliding/full layers, logit softcap, 1 KV head
    prompts = [list(range(5, 23)), [7, 3, 9]]  # the first is longer than the window of 5
    engine = dcpgraph.compile(model, tp=2, dcp=2, comm="ag", block_size=4)
    assert engine.generate(prompts, 10) == [hf_greedy(model, p, 10) for p in prompts]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_ag_inside_a_larger_tp_group_keeps_o_proj_sharded(name):
    """tp=4, dcp=2: each DCP group's ranks compute the group's 4 query heads (q_proj split in two,
    not four); o_proj keeps its TP shard and its all-reduce, reading this rank's heads of the
    merge. Qwen3 has 2 KV heads, so the groups {0,1} and {2,3} shard different KV heads."""
    m = build_model(name)
    layers = m.config.num_hidden_layers
    engine = dcpgraph.compile(m, tp=4, dcp=2, comm="ag", interleave=2, block_size=BLOCK_SIZE,
                              max_num_batched_tokens=MAX_BATCHED)
    assert engine.generate([list(p) for p in PROMPTS], MAX_NEW) == [hf_greedy(m, p, MAX_NEW) for p in PROMPTS]
    program = engine.program
    assert _collectives(program, ALL_GATHER.op).get("dcp") == layers
    a2a = dcpgraph.compile(m, tp=4, dcp=2, comm="a2a", interleave=2, block_size=BLOCK_SIZE).program
    assert _collectives(program, ALL_REDUCE.op) == _collectives(a2a, ALL_REDUCE.op)  # o_proj's stays
    assert _collectives(a2a, ALL_GATHER.op).get("dcp") == layers  # a2a's is the query gather
    program = program.stage("fuse_mla_preprocess")  # before fuse_linears stacks q/k/v
    rules = {s.target: s.shard for s in program.inputs}
    assert rules["model.layers.0.self_attn.q_proj.weight"] == ShardRule(0, 2)
    assert rules["model.layers.0.self_attn.o_proj.weight"] == ShardRule(1)
    full = m.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    q_index = [s.target for s in program.inputs if s.kind == "param"].index("model.layers.0.self_attn.q_proj.weight")
    for rank in range(4):  # ranks 0, 1 hold the first half of the heads, ranks 2, 3 the second
        assert torch.equal(program.local_state(rank)[q_index], full.chunk(2)[rank // 2])


def test_ag_refuses_an_output_projection_without_its_own_all_reduce():
    from dcpgraph.errors import UnsupportedModelError
    from dcpgraph.passes.shard_dcp_replicated import replicate_projections

    # fuse_linears off: shard_dcp (which calls this) sees q/k/v as separate linears
    program = dcpgraph.compile(build_model("llama"), tp=2, dcp=1, block_size=BLOCK_SIZE, fuse_linears=False).program
    specs = {s.name: s for s in program.inputs}
    # A tp=2 graph's layer: column-parallel q_proj, row-parallel o_proj feeding its all-reduce, so
    # the first call lowers it; the second finds the all-reduce gone and refuses by name.
    gm = program.copy_graph()
    read = nodes_calling(gm.graph, torch.ops.dcpgraph.paged_attention.default)[0]
    rules: dict = {}
    e = Emitter(gm.graph)
    replicate_projections(gm.graph, e, read, specs, rules, 2, 2, None)
    assert len(rules) == 2 and set(rules.values()) == {REPLICATE}
    with pytest.raises(UnsupportedModelError, match=r"one TP all-reduce of its own.*'a2a' or 'ag_rs'"):
        replicate_projections(gm.graph, e, read, specs, {}, 2, 2, None)


def test_ag_refuses_a_head_sharded_parameter_between_the_projections():
    import dataclasses

    from dcpgraph.errors import UnsupportedModelError
    from dcpgraph.passes.shard_dcp_replicated import replicate_projections

    program = dcpgraph.compile(build_model("qwen3"), tp=2, dcp=1, block_size=BLOCK_SIZE).program
    gm = program.copy_graph()
    read = nodes_calling(gm.graph, torch.ops.dcpgraph.paged_attention.default)[0]
    specs = {s.name: s for s in program.inputs}
    # Qwen3's q_norm weight lies between q_proj and the attention; replicated it is fine (as in
    # the e2e runs), sharded per head (as a sink logit would be) it would hold half the heads.
    (norm,) = [s for s in program.inputs if s.target == "model.layers.0.self_attn.q_norm.weight"]
    specs[norm.name] = dataclasses.replace(norm, shard=ShardRule(0))
    with pytest.raises(UnsupportedModelError, match=r"q_norm.weight, sharded by .* between its projections"):
        replicate_projections(gm.graph, Emitter(gm.graph), read, specs, {}, 2, 2, None)


def _gloo_rank(rank: int, world: int, name: str, dcp: int):
    model = build_model(name)
    engine = dcpgraph.compile(model, tp=world, dcp=dcp, comm="ag", block_size=BLOCK_SIZE,
                              max_num_batched_tokens=MAX_BATCHED)
    return {"tokens": engine.generate([list(p) for p in PROMPTS], MAX_NEW), "report": engine.report()}


@pytest.mark.gloo
@pytest.mark.parametrize("world, name, dcp", [
    (2, "llama", 2),  # the DCP group is the TP group: o_proj whole, no attention all-reduce
    pytest.param(4, "qwen3", 2, marks=pytest.mark.slow),  # two DCP groups, each its own KV head
])
def test_ag_on_gloo_ranks_generates_hf_tokens(world, name, dcp):
    results = spawn(_gloo_rank, world, name, dcp, timeout_s=180)
    model = build_model(name)
    assert all(r["report"]["executor"] == "distributed" and r["report"]["comm"] == "ag" for r in results)
    assert all(r["tokens"] == results[0]["tokens"] for r in results)
    assert results[0]["tokens"] == [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]


# -- the exchange alone: each rank's partial over its KV shard, merged, against dense attention --
def _exchange_graph(n: int, heads: int, dv: int) -> torch.fx.GraphModule:
    from dcpgraph.passes.shard_dcp_replicated import merge_all_heads

    graph = torch.fx.Graph()
    o_c, lse_c = graph.placeholder("o_c"), graph.placeholder("lse_c")
    out, lse = merge_all_heads(graph, Emitter(graph), o_c, lse_c, n, heads, dv, torch.float64, torch.float32)
    graph.output((out, lse))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _shards(n: int, tokens: int = 3, heads: int = 4, d: int = 16, keys: int = 11, seed: int = 0):
    """(q, k, v) and each rank's (o, lse) over its interleaved key shard (rank r: keys r, r+n, …);
    a shard may be empty (lse −inf, output 0), as a rank with no tokens yet is."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, d, generator=g, dtype=torch.float64)
    k = torch.randn(keys, d, generator=g, dtype=torch.float64)
    v = torch.randn(keys, d, generator=g, dtype=torch.float64)
    parts = []
    for r in range(n):
        ks, vs = k[r::n], v[r::n]
        scores = torch.einsum("thd,kd->thk", q, ks)
        lse = torch.logsumexp(scores, -1) if len(ks) else torch.full(scores.shape[:2], float("-inf"), dtype=q.dtype)
        out = torch.softmax(scores, -1) @ vs if len(ks) else torch.zeros(tokens, heads, d, dtype=q.dtype)
        parts.append((out, lse.float()))
    dense = torch.softmax(torch.einsum("thd,kd->thk", q, k), -1) @ v
    return parts, dense, torch.logsumexp(torch.einsum("thd,kd->thk", q, k), -1)


@pytest.mark.parametrize("n, keys", [(2, 11), (4, 3)])  # (4, 3): rank 3 holds no key
def test_exchange_merges_every_head_like_dense_attention_emulated(n, keys):
    from dcpgraph.mesh import Mesh
    from dcpgraph.runtime.emulator import run_spmd

    parts, dense, dense_lse = _shards(n, keys=keys)
    outputs = run_spmd(_exchange_graph(n, 4, 16), [list(p) for p in parts], Mesh(n, n))
    for out, lse in outputs:  # every rank holds every head's exact result
        # The partial LSEs arrive in fp32 (as the attention ops give them): that bounds the error.
        torch.testing.assert_close(out, dense, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse, dense_lse, rtol=1e-6, atol=1e-6)
        assert out.dtype == lse.dtype == torch.float64  # fp64 partials accumulate in fp64


def _gloo_exchange(rank: int, world: int):
    from dcpgraph.mesh import Mesh
    from dcpgraph.runtime.distributed import run_distributed_graph

    parts, _, _ = _shards(world)
    return run_distributed_graph(_exchange_graph(world, 4, 16), parts[rank], Mesh(world, world))


@pytest.mark.gloo
def test_exchange_on_gloo_matches_dense_attention():
    _, dense, dense_lse = _shards(2)
    for out, lse in spawn(_gloo_exchange, 2, timeout_s=60):
        torch.testing.assert_close(out, dense, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse, dense_lse, rtol=1e-6, atol=1e-6)


def test_ag_names_the_same_sharded_parameter_every_time():
    """The refusal walks the attention's inputs in graph order (it once walked a set, and named
    ``absorbed_uk`` or ``absorbed_uv_t`` depending on the run's hash seed)."""
    from dcpgraph.models import build_model

    program = dcpgraph.trace(build_model("deepseek_v2"))
    messages = set()
    for _ in range(3):
        with pytest.raises(UnsupportedModelError, match="comm='ag': .* uses .*absorbed_uk, sharded") as err:
            dcpgraph.compile(program, tp=2, dcp=2, comm="ag", block_size=4)
        messages.add(str(err.value))
    assert len(messages) == 1
