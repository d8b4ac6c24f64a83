"""torchair GE lowering of a DeepSeek-V3.2 sparse-attention (DSA) decode program at tp=2, dcp=2.

One spawn of two gloo ranks (as ``test_torchair_ge``): each builds the DSA program (one layer, fp32,
block size 128, a2a), runs one step of three requests (a long context, a context of one token only
DCP rank 0 holds, a two-token prefill with no context) eagerly as the reference, then compiles it
through torchair's GE mode (conversion dumps the GE graph; GE compile, a stand-in here, fails at the
first call and the graph falls back to eager), and runs the *lowered* graph with CPU references of
LightningIndexer / SparseFlashAttention (:mod:`sparse_npu_ops`): every node must convert, the dump
must hold the indexer, the sparse attention and the DCP all-gathers, and the lowered graph must
reproduce eager's logits and caches (the max/sum → LSE conversion and the empty-shard masking
included).
"""

from __future__ import annotations

import collections
import os
import time

import pytest
import sfa_models_path  # noqa: F401 - puts tests/ on sys.path for sfa_models
import torch
import torchair_support as ts
from test_torchair_ge import _clone, _max_diff, _outputs, _step_args

pytestmark = [pytest.mark.torchair, pytest.mark.slow]  # GE graph builds: ~30 s of set-up each
WORLD = 2


def _rank(rank: int, world: int, tier, dump_root: str, mlapo: bool):
    start = time.perf_counter()
    import sfa_models
    import sparse_npu_ops

    sparse_npu_ops.declare()  # before torchair imports its converters for these two ops
    ts.activate(tier)
    sparse_npu_ops.register_ge_irs()
    ts.register_cpu_references()
    sparse_npu_ops.register_cpu_references()

    import dcpgraph
    from dcpgraph.backends import registry
    from dcpgraph.backends.fallback import FallbackGraph
    from dcpgraph.passes.pipeline import compile_program
    from dcpgraph.runtime.distributed import register_mesh_groups

    mesh = dcpgraph.Mesh(WORLD, WORLD)
    register_mesh_groups(mesh)
    model = sfa_models.build("deepseek_v32", layers=1).to(torch.float32)
    program = compile_program(dcpgraph.trace(model), mesh, block_size=128, comm="a2a", mlapo=mlapo,
                              fuse_new=False)  # as compile(backend="torchair") builds
    args = _step_args(program, mesh, rank)
    ref_args = _clone(args)
    reference = _outputs(program, ref_args, program.graph_module(*ref_args))
    dump = os.path.join(dump_root, f"sfa-rank{rank}")
    built = {}

    def factory(gm, example_inputs):
        built["graph"] = registry._torchair(gm, example_inputs, dump_dir=dump, merge="auto")
        return built["graph"]

    factory.__name__ = "_torchair"
    graph = FallbackGraph("step", program.graph_module, factory)
    fb_args = _clone(args)
    fell_back = _outputs(program, fb_args, graph(*fb_args))
    if "graph" not in built:  # lowering or conversion failed before a graph existed
        raise RuntimeError(f"torchair compile failed: {graph.status}\n{graph.status.get('traceback', '')}")
    lowered = built["graph"].lowered
    low_args = _clone(args)
    lowered_out = _outputs(program, low_args, lowered(*low_args))
    return {
        "status": {k: v for k, v in graph.status.items() if k != "traceback"},
        "traceback": graph.status.get("traceback", ""),
        "fallback_exact": _max_diff(fell_back, reference) == 0.0,
        "lowered_max_diff": _max_diff(lowered_out, reference),
        "lowered_counts": dict(lowered.meta["lower_npu"]),
        "dcpgraph_ops_left": [str(n.target) for n in lowered.graph.nodes
                              if getattr(n.target, "namespace", None) == "dcpgraph"],
        "device_kwargs": [n.name for n in lowered.graph.nodes if n.kwargs.get("device") is not None],
        "dump": dump,
        "fused_mla_preprocess": sum(1 for n in program.graph_module.graph.nodes
                                    if n.target is torch.ops.dcpgraph.mla_preprocess.default),
        "seconds": time.perf_counter() - start,
    }


@pytest.fixture(scope="module", params=[True, False], ids=["mlapo", "unfused"])
def sfa_run(tmp_path_factory, request):
    from dcpgraph.runtime.distributed import spawn

    tier = ts.prepare()
    if tier.skip_reason:
        pytest.skip(tier.skip_reason)
    ranks = spawn(_rank, WORLD, tier, str(tmp_path_factory.mktemp("sfa_dumps")), request.param, timeout_s=400)
    for result in ranks:
        result["mlapo"] = request.param
    for rank, result in enumerate(ranks):
        if not result["status"]["fallback"].startswith("first call failed: GeUnavailableError"):
            print(f"\nrank {rank} conversion failed:\n{result['traceback'][-2500:]}")
        ops = collections.Counter(n["op"] for n in ts.read_ge_dump(result["dump"]))
        print(f"\nrank {rank}: {result['seconds']:.1f} s, lowered {result['lowered_counts']}, GE ops "
              f"{ {k: ops[k] for k in ('LightningIndexer', 'SparseFlashAttention', 'HcomAllGather', 'HcomAllToAll', 'TopKV2') if ops[k]} }")
    return ranks


@pytest.mark.parametrize("rank", range(WORLD))
def test_every_node_of_the_sfa_program_converts(sfa_run, rank):
    result = sfa_run[rank]
    assert result["fused_mla_preprocess"] == (1 if result["mlapo"] else 0)  # one MLA layer, fused or not
    assert result["dcpgraph_ops_left"] == [] and result["device_kwargs"] == []
    assert result["status"]["fallback"].startswith("first call failed: GeUnavailableError"), (
        result["status"], result["traceback"])
    ops = collections.Counter(n["op"] for n in ts.read_ge_dump(result["dump"]))
    assert ops["LightningIndexer"] == 1 and ops["SparseFlashAttention"] == 1, ops
    assert ops["HcomAllGather"] >= 3, ops  # query heads, candidate scores, candidate positions
    assert ops["HcomAllToAll"] + ops["HcomAllToAllV"] >= 1, ops  # the a2a LSE merge
    assert not [op for op in ops if "Indexer" in op and op != "LightningIndexer"], ops
    assert result["lowered_counts"] == {
        "paged_indexer_topk->LightningIndexer": 1, "paged_sparse_attention(mla)->SparseFlashAttention": 1,
        "merge_topk->aten(topk)": 1, **{k: v for k, v in result["lowered_counts"].items()
                                        if not k.startswith(("paged_indexer", "paged_sparse", "merge_topk"))},
    }


@pytest.mark.parametrize("rank", range(WORLD))
def test_lowered_sfa_graph_reproduces_eager(sfa_run, rank):
    result = sfa_run[rank]
    assert result["fallback_exact"]
    assert result["lowered_max_diff"] < 1e-4, result["lowered_max_diff"]
