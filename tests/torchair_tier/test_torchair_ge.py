"""torchair GE lowering of real DCP decode programs, on CPU (the ``torchair`` tier).

One spawn of two gloo ranks (Mesh(2, 2): tp=2, dcp=2, so the TP and DCP groups both hold ranks
{0, 1} but are distinct communicators) runs every case; the tests below read its results. Each
rank, for each case (GQA qwen3 with a2a and with ag_rs, MLA deepseek_v3 with a2a; one layer,
block size 128, fp32):

1. builds the program and one decode step's inputs (three requests: a long context, a context of
   one token that only DCP rank 0 holds, and a two-token prefill chunk with no context at all);
2. runs the program eagerly (the reference);
3. compiles it through :func:`dcpgraph.backends.torchair.compile_torchair` (GE mode, graph dump
   to a per-rank directory) inside :class:`~dcpgraph.backends.fallback.FallbackGraph` and calls
   it: dynamo traces the lowered graph, torchair converts every node to GE and dumps the graph,
   then GE compile — a Python stand-in here — fails at the first call, so the graph falls back to
   eager and must return the reference's outputs;
4. runs the *lowered* GraphModule eagerly with CPU reference kernels for the two Ascend ops
   (:func:`torchair_support.register_cpu_references`) and compares it with the reference, which
   checks dcpgraph's side of the lowering (KV writes with −1 slots, empty-row masking, merge edge
   rules, reshapes and length conventions) without Ascend hardware.

Everything torchair-related happens in the spawned ranks (see ``torchair_support``).
"""

from __future__ import annotations

import collections
import os
import time

import pytest
import torch
import torchair_support as ts

pytestmark = [pytest.mark.torchair, pytest.mark.slow]  # GE graph builds: ~30 s of set-up each

# name: (architecture, comm, lower_npu merge mode)
CASES = {
    "gqa-a2a": ("qwen3", "a2a", "auto"),
    "gqa-ag_rs": ("qwen3", "ag_rs", "aten"),
    "mla-a2a": ("deepseek_v3", "a2a", "auto"),
}
BLOCK_SIZE = 128
WORLD = 2
DCPGRAPH_OP_NAMES = ("PagedAttention", "PartialAttention", "MergeAttention", "RescaleToGlobal",
                     "KvCacheWrite")


# -- worker side ----------------------------------------------------------------------------------
def _step_args(program, mesh, rank: int):
    """One step for three requests; caches filled with random data (as if earlier steps ran)."""
    from dcpgraph.runtime.executors import allocate_caches, rank_arguments
    from dcpgraph.runtime.step_inputs import Chunk, build_step_inputs

    chunks = [
        Chunk(0, (5,), 200, (0, 1)),  # decode after 200 tokens: both DCP ranks hold 100
        Chunk(1, (7,), 1, (2,)),  # decode after 1 token: DCP rank 1 holds none of it
        Chunk(2, (9, 11), 0, (3,)),  # a 2-token prefill chunk: no context anywhere
    ]
    shared, per_rank = build_step_inputs(chunks, mesh, BLOCK_SIZE, 1)
    gen = torch.Generator().manual_seed(1234 + rank)
    caches = allocate_caches(program, 6)
    for cache in caches.values():
        cache.copy_(torch.randn(cache.shape, generator=gen, dtype=cache.dtype))
    return rank_arguments(program, program.local_state(rank), caches, shared, per_rank[rank])


def _clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _outputs(program, args, result):
    """(logits, {cache name: cache}) after a step."""
    logits = result[0] if isinstance(result, (tuple, list)) else result
    caches = {s.name: a for s, a in zip(program.inputs, args) if s.kind == "cache"}
    return logits, caches


def _max_diff(a, b) -> float:
    la, ca = a
    lb, cb = b
    diffs = [(la - lb).abs().max().item()] + [(ca[k] - cb[k]).abs().max().item() for k in ca]
    return max(diffs)


def _rank(rank: int, world: int, tier, cases: dict, dump_root: str):
    times = {}
    start = time.perf_counter()
    ts.activate(tier)
    ts.register_cpu_references()
    times["import torchair + stand-ins"] = time.perf_counter() - start

    import dcpgraph
    from dcpgraph.backends import registry
    from dcpgraph.backends.fallback import FallbackGraph
    from dcpgraph.models import build_model
    from dcpgraph.passes.pipeline import compile_program
    from dcpgraph.runtime.distributed import register_mesh_groups

    mesh = dcpgraph.Mesh(WORLD, WORLD)
    register_mesh_groups(mesh)
    results = {}
    for name, (arch, comm, merge) in cases.items():
        t0 = time.perf_counter()
        program = compile_program(dcpgraph.trace(build_model(arch, dtype=torch.float32, layers=1)), mesh,
                                  block_size=BLOCK_SIZE, comm=comm, fuse_new=False)  # as compile(backend="torchair") builds
        t1 = time.perf_counter()
        args = _step_args(program, mesh, rank)
        ref_args = _clone(args)
        reference = _outputs(program, ref_args, program.graph_module(*ref_args))

        dump = os.path.join(dump_root, f"{name}-rank{rank}")
        built = {}

        def factory(gm, example_inputs, dump=dump, merge=merge, built=built):
            built["graph"] = registry._torchair(gm, example_inputs, dump_dir=dump, merge=merge)
            return built["graph"]

        factory.__name__ = "_torchair"
        graph = FallbackGraph("step", program.graph_module, factory)
        fb_args = _clone(args)
        fell_back = _outputs(program, fb_args, graph(*fb_args))
        t2 = time.perf_counter()

        lowered = built["graph"].lowered
        low_args = _clone(args)
        lowered_out = _outputs(program, low_args, lowered(*low_args))
        t3 = time.perf_counter()
        results[name] = {
            "status": {k: v for k, v in graph.status.items() if k != "traceback"},
            "traceback": graph.status.get("traceback", ""),
            "fallback_exact": _max_diff(fell_back, reference) == 0.0,
            "lowered_max_diff": _max_diff(lowered_out, reference),
            "lowered_counts": dict(lowered.meta["lower_npu"]),
            "dcpgraph_ops_left": [str(n.target) for n in lowered.graph.nodes
                                  if getattr(n.target, "namespace", None) == "dcpgraph"],
            # a device baked into the lowered graph would break it on an NPU (programs are traced
            # on CPU): every new tensor must inherit its device from an input
            "device_kwargs": [n.name for n in lowered.graph.nodes if n.kwargs.get("device") is not None],
            "dump": dump,
            "seconds": {"program": t1 - t0, "convert+fallback": t2 - t1, "lowered eager": t3 - t2},
        }
    times["total"] = time.perf_counter() - start
    return {"times": times, "cases": results}


# -- pytest side ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tier():
    prepared = ts.prepare()
    if prepared.skip_reason:
        pytest.skip(prepared.skip_reason)
    return prepared


@pytest.fixture(scope="module")
def ge_run(tier, tmp_path_factory):
    from dcpgraph.runtime.distributed import spawn

    dump_root = tmp_path_factory.mktemp("ge_dumps")
    start = time.perf_counter()
    ranks = spawn(_rank, WORLD, tier, CASES, str(dump_root), timeout_s=240)
    wall = time.perf_counter() - start
    print(f"\ntorchair tier: spawn of {WORLD} ranks took {wall:.1f} s; rank 0: {ranks[0]['times']}")
    for name, result in ranks[0]["cases"].items():
        counts = _op_counts(ts.read_ge_dump(result["dump"]))
        keys = ("FusedInferAttentionScore", "AttentionUpdate", "HcomAllGather", "HcomAllToAll",
                "HcomAllToAllV", "HcomReduceScatter", "HcomAllReduce", "ScatterElements")
        print(f"  {name}: {result['seconds']} GE ops: {({k: counts[k] for k in keys if counts[k]})}"
              f" ({sum(counts.values())} nodes); lowered: {result['lowered_counts']}")
    return ranks


def _op_counts(nodes) -> collections.Counter:
    return collections.Counter(n["op"] for n in nodes)


def _case(ge_run, name: str, rank: int = 0) -> dict:
    return ge_run[rank]["cases"][name]


@pytest.mark.parametrize("rank", range(WORLD))
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_node_converts(ge_run, name, rank):
    """Conversion finished (the first call failed in GE compile, after it) and nothing of
    dcpgraph's reached GE."""
    result = _case(ge_run, name, rank)
    assert result["dcpgraph_ops_left"] == []
    assert result["device_kwargs"] == []
    assert result["status"]["fallback"].startswith("first call failed: GeUnavailableError"), (
        result["status"], result["traceback"])
    nodes = ts.read_ge_dump(result["dump"])
    assert nodes, f"no GE graph dump in {result['dump']}"
    ops = _op_counts(nodes)
    assert not [op for op in ops if any(d in op for d in DCPGRAPH_OP_NAMES)], ops
    assert ops["Data"] > 0 and ops["NetOutput"] == 1


def _fias(nodes):
    return [n for n in nodes if n["op"] == "FusedInferAttentionScore"]


def _dcp_and_tp_groups(nodes):
    groups = collections.defaultdict(set)
    for n in nodes:
        if n["op"].startswith("Hcom"):
            groups[n["op"]].add(n["attrs"].get("group"))
    return groups


@pytest.mark.parametrize("name", ["gqa-a2a", "mla-a2a"])
def test_a2a_ge_graph(ge_run, name):
    nodes = ts.read_ge_dump(_case(ge_run, name)["dump"])
    ops = _op_counts(nodes)
    # per layer: one paged (context) FIAS + one for the new tokens; the a2a merge and the final
    # context/new merge both fit npu_attention_update (2 partials, Dv 16 / 32)
    assert ops["FusedInferAttentionScore"] == 2
    assert ops["AttentionUpdate"] == 2
    assert ops["HcomAllGather"] >= 1 and ops["HcomAllToAll"] + ops["HcomAllToAllV"] == 1
    assert ops["HcomReduceScatter"] == 0
    paged = [n for n in _fias(nodes) if n["inputs"].get("block_table")]
    assert len(paged) == 1
    attrs = paged[0]["attrs"]
    assert attrs["input_layout"] == "TND" and attrs["softmax_lse_flag"] is True
    assert attrs["block_size"] == BLOCK_SIZE and attrs["num_heads"] == 8  # 4 local heads × dcp 2
    assert paged[0]["inputs"]["actual_seq_lengths_kv"]
    update_types = sorted(n["attrs"]["update_type"] for n in nodes if n["op"] == "AttentionUpdate")
    assert update_types == [0, 1]  # the a2a merge's lse feeds the final merge; the final one's is unused
    groups = _dcp_and_tp_groups(nodes)
    a2a = groups.get("HcomAllToAllV", set()) | groups.get("HcomAllToAll", set())
    assert a2a and not a2a & groups["HcomAllReduce"], groups  # DCP group ≠ TP group


def test_mla_uses_rope_inputs(ge_run):
    nodes = ts.read_ge_dump(_case(ge_run, "mla-a2a")["dump"])
    for fias in _fias(nodes):
        assert fias["inputs"]["query_rope"] and fias["inputs"]["key_rope"], fias["name"]
        assert fias["attrs"]["num_key_value_heads"] == 1
    assert _case(ge_run, "mla-a2a")["lowered_counts"]["paged_attention(mla)->FIAS"] == 1


def test_ag_rs_ge_graph(ge_run):
    nodes = ts.read_ge_dump(_case(ge_run, "gqa-ag_rs")["dump"])
    ops = _op_counts(nodes)
    assert ops["FusedInferAttentionScore"] == 2
    assert ops["HcomReduceScatter"] == 1
    assert ops["HcomAllGather"] >= 2  # the queries and the LSEs (plus the vocab-parallel logits)
    assert ops["HcomAllToAll"] + ops["HcomAllToAllV"] == 0
    # merge="aten": the final merge and rescale_to_global are plain aten, no AttentionUpdate
    # (exp in both; log only in rescale_to_global: the final merge's lse is unused, so dropped)
    assert ops["AttentionUpdate"] == 0 and ops["Exp"] >= 2 and ops["Log"] >= 1
    assert _case(ge_run, "gqa-ag_rs")["lowered_counts"]["merge_attention->aten"] == 1


@pytest.mark.parametrize("rank", range(WORLD))
@pytest.mark.parametrize("name", sorted(CASES))
def test_fallback_gives_eager_outputs(ge_run, name, rank):
    result = _case(ge_run, name, rank)
    assert result["status"]["backend"] == "eager"
    assert result["fallback_exact"]


@pytest.mark.parametrize("rank", range(WORLD))
@pytest.mark.parametrize("name", sorted(CASES))
def test_lowered_graph_matches_eager(ge_run, name, rank):
    """The lowered graph, run with CPU references of the Ascend ops, gives eager's logits and
    caches (checks the aten side of the lowering; not the Ascend kernels)."""
    assert _case(ge_run, name, rank)["lowered_max_diff"] < 1e-4


def test_fallback_when_torchair_is_missing():
    """In this process torchair is not importable: compile fails, the graph runs eagerly."""
    import importlib.util

    if importlib.util.find_spec("torch_npu") or importlib.util.find_spec("torchair"):
        pytest.skip("torchair is importable here")
    from dcpgraph.backends import registry
    from dcpgraph.backends.fallback import FallbackGraph

    def f(outs, lses):
        return torch.ops.dcpgraph.merge_attention(outs, lses)

    gm = torch.fx.symbolic_trace(f)
    outs, lses = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4)
    name, factory = registry.resolve_backend("torchair")
    graph = FallbackGraph("merge", gm, factory)
    with pytest.warns(RuntimeWarning, match="runs eagerly"):
        got = graph(outs, lses)
    want = gm(outs, lses)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert graph.status["backend"] == "eager"
    assert graph.status["fallback"].startswith("compile failed: ImportError")
    assert "torch-npu" in graph.status["fallback"]
