"""``lower_npu`` in this process, without torchair: the aten parts of the lowering, run on CPU.

The merge, the AG+RS rescale and the KV-cache write lower to plain aten ops (no Ascend op, no
wheel needed), so their lowered graphs run here and must match dcpgraph's reference kernels on the
edge cases of :mod:`dcpgraph.ops.merge` (empty shards with NaN outputs, NaN/+inf LSEs, rows where
every shard is empty) and of ``kv_cache_write_`` (slot −1, a step where this rank owns nothing).
The Ascend ops themselves are only looked up when needed, and their absence is a clear error.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dcpgraph.backends.npu import NpuLoweringError, lower_npu
from dcpgraph.ops.merge import merge_attention_reference, rescale_to_global_reference

pytestmark = pytest.mark.torchair
ops = torch.ops.dcpgraph


def _trace(fn):
    return torch.fx.symbolic_trace(fn)


def _merge_graph():
    def f(outs, lses):
        out, lse = ops.merge_attention.default(outs, lses)
        return out, lse

    return _trace(f)


def _edge_case_partials(n=3, t=5, h=2, d=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    outs = torch.randn(n, t, h, d, generator=gen).to(dtype)
    lses = (torch.randn(n, t, h, generator=gen) * 3).to(torch.promote_types(dtype, torch.float32))
    lses[0, 0] = float("-inf")  # shard 0 empty for token 0 ...
    outs[0, 0] = float("nan")  # ... with a NaN output, which must not leak
    lses[1, 1] = float("nan")  # NaN lse counts as empty
    lses[2, 2] = float("inf")  # so does +inf
    lses[:, 3] = float("-inf")  # token 3: every shard empty -> (0, -inf)
    outs[:, 3] = float("nan")
    return outs, lses


def _same(got, want, atol=1e-6):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = ~torch.isneginf(want)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got[finite], want[finite], atol=atol, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_aten_merge_matches_reference(dtype):
    outs, lses = _edge_case_partials(dtype=dtype)
    gm = _merge_graph()
    lowered = lower_npu(gm, [outs, lses], merge="aten")
    assert lowered.meta["lower_npu"] == {"merge_attention->aten": 1}
    got = lowered(outs, lses)
    want = merge_attention_reference(outs, lses)
    _same(got[0], want[0])
    _same(got[1], want[1])


def test_auto_merge_falls_back_to_aten_outside_npu_limits():
    """17 partials (dcp > 16), a head dim of 4 and fp64 are all beyond npu_attention_update."""
    for outs, lses in (
        (torch.randn(17, 2, 2, 8), torch.randn(17, 2, 2)),
        (torch.randn(2, 2, 2, 4), torch.randn(2, 2, 2)),
        (torch.randn(2, 2, 2, 8, dtype=torch.float64), torch.randn(2, 2, 2, dtype=torch.float64)),
    ):
        lowered = lower_npu(_merge_graph(), [outs, lses], merge="auto")
        assert lowered.meta["lower_npu"] == {"merge_attention->aten": 1}
        want = merge_attention_reference(outs, lses)
        got = lowered(outs, lses)
        torch.testing.assert_close(got[0], want[0])
    with pytest.raises(NpuLoweringError, match="17 partials > 16"):
        lower_npu(_merge_graph(), [torch.randn(17, 2, 2, 8), torch.randn(17, 2, 2)], merge="npu")


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu present")
def test_missing_ascend_ops_are_a_clear_error():
    if hasattr(torch.ops.npu, "npu_attention_update"):
        pytest.skip("npu ops declared in this process")
    outs, lses = torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2)
    with pytest.raises(NpuLoweringError, match="npu_attention_update is not registered"):
        lower_npu(_merge_graph(), [outs, lses], merge="npu")

    def paged(q, kc, vc, table, cu, lens):
        return ops.paged_attention.default(q, kc, vc, table, cu, lens, None, 0.5)[0]

    example = [torch.randn(3, 4, 16), torch.randn(2, 128, 1, 16), torch.randn(2, 128, 1, 16),
               torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32),
               torch.tensor([5], dtype=torch.int32)]
    if not hasattr(torch.ops.air, "npu_fused_infer_attention_score"):
        with pytest.raises(NpuLoweringError, match="comes with torchair"):
            lower_npu(_trace(paged), example)


def test_rescale_to_global_matches_reference():
    gen = torch.Generator().manual_seed(1)
    out = torch.randn(5, 4, 8, generator=gen)
    lses_all = torch.randn(2, 5, 4, generator=gen)
    lses_all[:, 0] = float("-inf")  # nothing anywhere
    lses_all[1, 1] = float("nan")
    lse = lses_all[0].clone()
    out[0] = float("nan")

    def f(out, lse, lses_all):
        scaled, lse_g = ops.rescale_to_global.default(out, lse, lses_all)
        return scaled, lse_g

    lowered = lower_npu(_trace(f), [out, lse, lses_all])
    got = lowered(out, lse, lses_all)
    want = rescale_to_global_reference(out, lse, lses_all)
    _same(got[0], want[0])
    _same(got[1], want[1])


@pytest.mark.parametrize("slots", [
    [5, -1, 130, 7, -1],  # some owned, some not
    [-1, -1, -1, -1, -1],  # this rank owns none of this step's tokens
    [0, 1, 2, 3, 4],  # all owned, including slot 0
    [-1, 0, -1, -1, 9],  # the first owned token writes slot 0
])
def test_kv_cache_write_matches_op(slots):
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(3, 128, 2, 8, generator=gen)
    new = torch.randn(5, 2, 8, generator=gen)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)

    def f(cache, new, slot_mapping):
        ops.kv_cache_write_.default(cache, new, slot_mapping)
        return (cache,)

    gm = _trace(f)
    text = str(gm.graph)
    lowered = lower_npu(gm, [cache, new, slot_mapping])
    assert str(gm.graph) == text, "lower_npu modified its input graph"
    assert lowered.meta["lower_npu"] == {"kv_cache_write_->scatter_": 1}
    assert not [n for n in lowered.graph.nodes if getattr(n.target, "namespace", None) == "dcpgraph"]
    want, got = cache.clone(), cache.clone()
    ops.kv_cache_write_(want, new, slot_mapping)
    lowered(got, new, slot_mapping)
    assert torch.equal(got, want)


def test_kv_cache_write_casts_to_cache_dtype():
    cache = torch.zeros(2, 128, 1, 8, dtype=torch.bfloat16)
    new = torch.randn(3, 1, 8)
    slots = torch.tensor([3, -1, 200])

    def f(cache, new, slot_mapping):
        ops.kv_cache_write_.default(cache, new, slot_mapping)
        return (cache,)

    want, got = cache.clone(), cache.clone()
    ops.kv_cache_write_(want, new, slots)
    lower_npu(_trace(f), [cache, new, slots])(got, new, slots)
    assert torch.equal(got, want)


def test_lowered_graphs_are_generic_in_sizes():
    """Lowering sees the example sizes in ``meta['val']``; a compiled step runs with others (token
    count, cache blocks), so no traced rule may bake them into the graph."""
    outs, lses = _edge_case_partials(t=5)
    lowered = lower_npu(_merge_graph(), [outs, lses], merge="aten")
    outs, lses = _edge_case_partials(t=9)
    got, want = lowered(outs, lses), merge_attention_reference(outs, lses)
    _same(got[0], want[0])
    _same(got[1], want[1])

    def f(cache, new, slot_mapping):
        ops.kv_cache_write_.default(cache, new, slot_mapping)
        return (cache,)

    example = [torch.zeros(3, 128, 2, 8), torch.randn(5, 2, 8), torch.tensor([5, -1, 130, 7, -1])]
    lowered = lower_npu(_trace(f), example)
    cache, new, slots = torch.randn(4, 128, 2, 8), torch.randn(2, 2, 8), torch.tensor([-1, 400])
    want, got = cache.clone(), cache.clone()
    ops.kv_cache_write_(want, new, slots)
    lowered(got, new, slots)
    assert torch.equal(got, want)


def test_native_cpu_ops_lower_to_their_aten_meaning():
    """linear_bf16 / rms_norm_bf16 (emitted for bf16 CPU weights) lower to aten and compute what
    torch's linear and HF's RMSNorm chain compute, bit for bit."""
    def f(x, w, b, g):
        y = ops.linear_bf16.default(x, w, b)
        return ops.rms_norm_bf16.default(y, g, 1e-6)

    gen = torch.Generator().manual_seed(0)
    x, w, b, g = (torch.randn(*s, generator=gen).to(torch.bfloat16) for s in ((3, 40), (24, 40), (24,), (24,)))
    lowered = lower_npu(_trace(f), [x, w, b, g])
    assert lowered.meta["lower_npu"] == {"linear_bf16->linear": 1, "rms_norm_bf16->aten": 1}
    y = torch.nn.functional.linear(x, w, b)
    h = y.float()
    want = g * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(lowered(x, w, b, g), want)


def test_rotary_lowers_to_hf_rotate_half():
    """rotary_embedding (emitted for CPU queries/keys) lowers to aten and computes HF's
    ``x * cos + rotate_half(x) * sin``, bit for bit."""
    def f(x, c, s):
        return ops.rotary_embedding.default(x, c, s)

    gen = torch.Generator().manual_seed(1)
    x, c, s = (torch.randn(*shape, generator=gen).to(torch.bfloat16) for shape in ((1, 4, 3, 16), (1, 1, 3, 16),
                                                                                  (1, 1, 3, 16)))
    lowered = lower_npu(_trace(f), [x, c, s])
    assert lowered.meta["lower_npu"] == {"rotary_embedding->aten": 1}
    want = x * c + torch.cat((-x[..., 8:], x[..., :8]), -1) * s
    assert torch.equal(lowered(x, c, s), want)
