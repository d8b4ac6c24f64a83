"""torchair GE conversion of an MLA program with MLAPO, on CPU (the ``torchair`` tier).

One spawn of two gloo ranks, ``Mesh(2, 2)`` (tp=2, dcp=2). The model is DeepSeek-V3 tiny with the
latent and rope sizes of the real model (``kv_lora_rank`` 512, rope 64: the only sizes
``npu_kv_rmsnorm_rope_cache`` documents), one layer, bf16, so the fused rule applies. Each rank, with
``mlapo`` on and off:

1. compiles the program (``mla_preprocess`` present with MLAPO, absent without) and one decode
   step's inputs (``test_torchair_ge``'s three requests: a long context, one held only by DCP rank 0,
   a prefill chunk with no context; some slots −1 on each rank);
2. runs it eagerly (the reference), then through the torchair backend in GE mode inside the eager
   fallback: every node converts and the graph is dumped, GE compile (a stand-in) fails at the
   first call, the fallback returns the reference's outputs.

The dump must hold ``KvRmsNormRopeCache`` with MLAPO (once per layer), not without, and nothing of
dcpgraph's either way. Not checked: the Ascend kernel's numerics.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torchair_support as ts
from test_torchair_ge import _clone, _max_diff, _outputs, _step_args

pytestmark = [pytest.mark.torchair, pytest.mark.slow]  # GE graph builds: ~30 s of set-up each
WORLD = 2
BLOCK_SIZE = 128


def _model():
    import transformers as tf

    from dcpgraph.models import tiny_config

    config = tiny_config("deepseek_v3", layers=1)
    config.kv_lora_rank = 512
    config.qk_rope_head_dim = config.head_dim = 64  # head_dim: the rotary embedding's size
    config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()


def _rank(rank: int, world: int, tier, dump_root: str):
    import os

    ts.activate(tier)

    import dcpgraph
    from dcpgraph.backends import registry
    from dcpgraph.backends.fallback import FallbackGraph
    from dcpgraph.passes.pipeline import compile_program
    from dcpgraph.runtime.distributed import register_mesh_groups

    mesh = dcpgraph.Mesh(WORLD, WORLD)
    register_mesh_groups(mesh)
    traced = dcpgraph.trace(_model())
    results = {}
    for mlapo in (True, False):
        program = compile_program(traced, mesh, block_size=BLOCK_SIZE, comm="a2a", mlapo=mlapo,
                                  fuse_new=False)  # as compile(backend="torchair") builds
        args = _step_args(program, mesh, rank)
        ref_args = _clone(args)
        reference = _outputs(program, ref_args, program.graph_module(*ref_args))
        dump = os.path.join(dump_root, f"mlapo-{mlapo}-rank{rank}")
        built = {}

        def factory(gm, example_inputs, dump=dump, built=built):
            built["graph"] = registry._torchair(gm, example_inputs, dump_dir=dump, merge="auto")
            return built["graph"]

        factory.__name__ = "_torchair"
        graph = FallbackGraph("step", program.graph_module, factory)
        fb_args = _clone(args)
        fell_back = _outputs(program, fb_args, graph(*fb_args))
        lowered = built["graph"].lowered
        results[mlapo] = {
            "fused_ops": sum(1 for n in program.graph_module.graph.nodes
                             if n.target is torch.ops.dcpgraph.mla_preprocess.default),
            "status": {k: v for k, v in graph.status.items() if k != "traceback"},
            "traceback": graph.status.get("traceback", ""),
            "fallback_exact": _max_diff(fell_back, reference) == 0.0,
            "lowered_counts": dict(lowered.meta["lower_npu"]),
            "dcpgraph_ops_left": [str(n.target) for n in lowered.graph.nodes
                                  if getattr(n.target, "namespace", None) == "dcpgraph"],
            "dump": dump,
        }
    return results


@pytest.fixture(scope="module")
def ge_run(tmp_path_factory):
    from dcpgraph.runtime.distributed import spawn

    prepared = ts.prepare()
    if prepared.skip_reason:
        pytest.skip(prepared.skip_reason)
    return spawn(_rank, WORLD, prepared, str(tmp_path_factory.mktemp("ge_mlapo")), timeout_s=300)


@pytest.mark.parametrize("rank", range(WORLD))
@pytest.mark.parametrize("mlapo", [True, False])
def test_mla_program_converts_with_the_fused_kv_op_only_under_mlapo(ge_run, mlapo, rank):
    result = ge_run[rank][mlapo]
    assert result["fused_ops"] == (1 if mlapo else 0)
    assert result["dcpgraph_ops_left"] == []
    assert result["status"]["fallback"].startswith("first call failed: GeUnavailableError"), (
        result["status"], result["traceback"])
    assert result["fallback_exact"]
    nodes = ts.read_ge_dump(result["dump"])
    ops = collections.Counter(n["op"] for n in nodes)
    assert not [op for op in ops if "MlaPreprocess" in op or "KvCacheWrite" in op], ops
    assert ops["KvRmsNormRopeCache"] == (1 if mlapo else 0), ops
    assert ops["FusedInferAttentionScore"] == 2 and ops["HcomAllGather"] >= 1
    if mlapo:
        assert result["lowered_counts"]["mla_preprocess->npu_kv_rmsnorm_rope_cache"] == 1
        (fused,) = [n for n in nodes if n["op"] == "KvRmsNormRopeCache"]
        assert fused["attrs"]["cache_mode"] == "PA" and fused["attrs"]["is_output_kv"] is True
    else:
        assert "mla_preprocess->npu_kv_rmsnorm_rope_cache" not in result["lowered_counts"]
        assert result["lowered_counts"]["kv_cache_write_->scatter_"] == 1
