"""DeepSeek-V4 and the torchair (GE) backend, without torchair: what ``lower_npu`` lowers of V4's
compressed ops, what it leaves and names, and the backend's early eager decision.

``compressed_merge_sinks`` lowers to aten ops and the lowered graph must reproduce the op's CPU
kernel (empty partials, a token no rank holds a key for, fp32 and fp64). A graph holding the other
V4 ops (the open-window compressor, the indexer, the attention: no GE form) lowers partially with
``strict=False`` (exactly the ops with rules replaced, the rest named) and is refused by name with
``strict=True``, by ``compile_torchair`` before torchair is imported, and by ``compile_backend``,
which records the reason instead of handing any graph to torchair. The traced tiny V4 through
``dcpgraph.compile(backend="torchair")`` is ``tests/torchair_tier/test_torchair_v4.py``.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import dcpgraph
from dcpgraph.backends import backend_provenance, compile_backend
from dcpgraph.backends.npu import NpuLoweringError, lower_npu
from dcpgraph.backends.npu.decide import ge_decision, unlowered_ops
from dcpgraph.ops import compressed_cached, compressed_dcp  # noqa: F401 - register the V4 ops

ops = torch.ops.dcpgraph
V4_NO_RULE = ["dcpgraph.compress_windows_.default", "dcpgraph.compressed_attention_dcp_.default",
              "dcpgraph.compressed_topk_dcp_.default"]


def _partials(dtype, n=3, h=2, t=5, d=8):
    gen = torch.Generator().manual_seed(4)
    outs = torch.randn(n, h, t, d, generator=gen, dtype=dtype)
    lses = 3 * torch.randn(n, h, t, generator=gen, dtype=torch.promote_types(dtype, torch.float32))
    lses[0, :, 1] = float("-inf")  # rank 0 holds no key of token 1 (its partial is zeros)
    outs[0, :, 1] = 0.0
    lses[:, 0, 3] = float("-inf")  # no rank holds a key of token 3, head 0: only the sink
    outs[:, 0, 3] = 0.0
    sinks = torch.randn(h, generator=gen, dtype=dtype)
    return outs, lses, sinks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_sinks_lowers_to_aten_equal_to_the_op(dtype):
    outs, lses, sinks = _partials(dtype)
    gm = torch.fx.symbolic_trace(lambda o, s, k: ops.compressed_merge_sinks.default(o, s, k))
    lowered = lower_npu(gm, [outs, lses, sinks])
    assert lowered.meta["lower_npu"] == {"compressed_merge_sinks->aten": 1}
    assert not unlowered_ops(lowered) and not [n for n in lowered.graph.nodes
                                                if getattr(n.target, "namespace", None) == "dcpgraph"]
    got, want = lowered(outs, lses, sinks), ops.compressed_merge_sinks.default(outs, lses, sinks)
    assert got.dtype == want.dtype and got.shape == want.shape == (1, 2, 5, 8)
    assert torch.equal(got[0, 0, 3], torch.zeros(8, dtype=dtype))  # the sink alone: output 0
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def _v4_rank_graph():
    """One DCP rank's CSA layer as ``shard_dcp`` leaves it (dcp=2, one request of 5 new tokens after
    3 cached, rate 2, window 3, top-2): the compressors, the rank's indexer, the candidates' merge,
    the rank's attention and the sink merge, with example values."""
    d, di, hi, h, n, rate, topk = 8, 4, 2, 2, 2, 2, 2

    def layer(kv, gate, bias, pool, slots, cu, ctx, iq, w, ik, pos, icache, table, rank, q, raw, ecache,
              kcache, sinks):
        entries = ops.compress_windows_.default(kv, gate, bias, pool, slots, cu, ctx, rate, False)
        vals, cand = ops.compressed_topk_dcp_.default(iq, w, ik, pos, icache, table, cu, ctx, rank, 0.5, rate,
                                                      topk, n, 1)
        chosen = ops.merge_topk.default(torch.stack([vals[0], vals[0]]), torch.stack([cand[0], cand[0]]), topk)
        out, lse = ops.compressed_attention_dcp_.default(q, raw, entries, pos, kcache, ecache, table, table, cu,
                                                         ctx, rank, 0.3, 3, rate, chosen.unsqueeze(0), n, 1)
        merged = ops.compressed_merge_sinks.default(torch.stack([out, out]), torch.stack([lse, lse]), sinks)
        return merged, chosen

    gen = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    t = 5
    example = [r(1, t, d), r(1, t, d), r(rate, d), torch.zeros(2, rate, 2 * d), torch.tensor([0]),
               torch.tensor([0, t]), torch.tensor([3]), r(1, t, hi, di), r(1, t, hi), r(1, t, di),
               torch.arange(3, 3 + t).unsqueeze(0), torch.zeros(4, 2, 1, di), torch.tensor([[0, 1, 2, 3]]),
               torch.tensor(0), r(n * h, t, d), r(1, 1, t, d), torch.zeros(4, 2, 1, d), torch.zeros(4, 2, 1, d),
               r(n * h)]  # the sinks of the heads whose partials are merged (here the group's N·H)
    return torch.fx.symbolic_trace(layer), example


def test_v4_rank_graph_lowers_its_merges_and_names_the_ops_with_no_ge_form():
    gm, example = _v4_rank_graph()
    lowered = lower_npu(gm, example, strict=False)
    assert lowered.meta["lower_npu"] == {"compressed_merge_sinks->aten": 1, "merge_topk->aten(topk)": 1}
    left = lowered.meta["lower_npu_left"]  # node name -> why, in graph order
    assert [why.split(":")[0] for why in left.values()] == [
        "dcpgraph.compress_windows_.default", "dcpgraph.compressed_topk_dcp_.default",
        "dcpgraph.compressed_attention_dcp_.default"]
    assert all(why.endswith("no lowering rule") for why in left.values())
    assert unlowered_ops(lowered) == unlowered_ops(gm) == V4_NO_RULE
    # the partly lowered graph still computes what the ops do (its aten merges are exact here)
    want = gm(*[a.clone() for a in example])
    got = lowered(*[a.clone() for a in example])
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    with pytest.raises(NpuLoweringError) as refused:
        lower_npu(gm, example)
    assert str(refused.value) == f"dcpgraph ops left after lower_npu (no lowering rule): {list(left)}"


def test_torchair_refuses_a_v4_graph_by_name_before_importing_torchair():
    from dcpgraph.backends.torchair import compile_torchair

    gm, example = _v4_rank_graph()
    had_torchair = "torchair" in sys.modules
    with pytest.raises(NpuLoweringError, match="no GE lowering for dcpgraph.compress_windows_.default, "
                                               "dcpgraph.compressed_attention_dcp_.default, "
                                               "dcpgraph.compressed_topk_dcp_.default: per-request loops"):
        compile_torchair(gm, example)
    assert ("torchair" in sys.modules) == had_torchair


def test_backend_decides_a_v4_program_eager_with_the_reason_and_others_not():
    gm, _ = _v4_rank_graph()
    program = types.SimpleNamespace(graph_module=gm, mesh=dcpgraph.Mesh(1, 1), provenance=(),
                                    replace=lambda **kw: types.SimpleNamespace(**kw))
    graphs = compile_backend(program, "torchair", distributed=False)
    assert not graphs.runs_compiled and graphs.get("mixed") is None  # nothing is handed to torchair
    report = graphs.report()
    assert report["backend"] == "torchair" and report["graphs"] == {}
    assert report["eager_reason"] == f"torchair (GE) not used, the program runs eagerly: {ge_decision(gm)}"
    assert all(op in report["eager_reason"] for op in V4_NO_RULE)
    (record,) = backend_provenance(program, graphs).provenance
    assert record.name == "backend" and record.summary == report["eager_reason"]
    # other backends, and graphs every op of which lowers, are left alone
    assert compile_backend(program, "inductor", distributed=False).eager_reason is None
    merge_only = torch.fx.symbolic_trace(lambda o, s, k: ops.compressed_merge_sinks.default(o, s, k))
    assert ge_decision(merge_only) is None
    other = types.SimpleNamespace(graph_module=merge_only, mesh=dcpgraph.Mesh(1, 1))
    graphs = compile_backend(other, "torchair", distributed=False)
    assert graphs.runs_compiled and "eager_reason" not in graphs.report()
    assert backend_provenance(other, graphs) is other
