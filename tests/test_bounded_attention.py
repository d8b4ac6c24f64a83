"""Attention under a per-query key bound (a DCP rank's local keys of a prefill chunk) takes the tiled
path (flash over the keys every query of a tile sees, the masked math path over the band only): it
must equal the masked math path over the whole chunk, which is written independently of it."""
from __future__ import annotations

import pytest
import torch

from dcpgraph.ops import kernels
from dcpgraph.ops.kernels import BOUND_TILE_QUERIES, _attend_math, attend


def _dcp_bound(lq: int, ctx: int, dcp: int, rank: int, interleave: int) -> torch.Tensor:
    """Local keys (of rank ``rank``) visible to each of ``lq`` queries at global positions
    ``ctx .. ctx+lq-1`` when tokens are dealt round-robin in runs of ``interleave``."""
    pos = torch.arange(ctx, ctx + lq)
    visible = pos + 1
    full, rest = visible // (dcp * interleave), visible % (dcp * interleave)
    return full * interleave + (rest - rank * interleave).clamp(0, interleave)


def _qkv(lq, lk, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(lq, hq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(lk, hkv, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(lk, hkv, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("dcp,rank,interleave,ctx", [(2, 0, 1, 0), (2, 1, 1, 37), (4, 3, 2, 5), (2, 1, 64, 200)])
def test_tiled_bound_equals_the_masked_math_path(dtype, tol, dcp, rank, interleave, ctx):
    lq = 3 * BOUND_TILE_QUERIES + 17
    bound = _dcp_bound(lq, ctx, dcp, rank, interleave)
    lk = int(bound.max())
    q, k, v = _qkv(lq, lk, 8, 2, 16, dtype)
    calls = []
    real = kernels._attend_bounded_tiles
    kernels._attend_bounded_tiles = lambda *a: calls.append(1) or real(*a)
    try:
        out, lse = attend(q, k, v, 0.25, kv_bound=bound)
    finally:
        kernels._attend_bounded_tiles = real
    ref, ref_lse = _attend_math(q, k, v, 0.25, causal=False, kv_bound=bound)
    assert calls, "a long non-decreasing bound must take the tiled path"
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tiled_bound_in_half_precision_is_as_close_to_fp64_as_the_masked_path(dtype, monkeypatch):
    """In bf16/fp16 the tiled path merges two rounded partials where the masked path rounds once: its
    error against the fp64 result must stay within the masked path's own (plus one half-precision
    ulp of the output), and its log-sum-exp (kept in fp32) close to fp64's."""
    lq = 2 * BOUND_TILE_QUERIES + 45
    bound = _dcp_bound(lq, 300, 2, 1, 1)
    q, k, v = _qkv(lq, int(bound.max()), 8, 2, 64, dtype, seed=4)
    calls, real = [], kernels._attend_bounded_tiles
    monkeypatch.setattr(kernels, "_attend_bounded_tiles", lambda *a: calls.append(1) or real(*a))
    tiled, tiled_lse = attend(q, k, v, 0.125, kv_bound=bound)
    assert calls, "a long non-decreasing bound must take the tiled path in half precision too"
    masked, _ = _attend_math(q, k, v, 0.125, causal=False, kv_bound=bound)
    exact, exact_lse = _attend_math(q.double(), k.double(), v.double(), 0.125, causal=False, kv_bound=bound)
    ulp = torch.finfo(dtype).eps * exact.abs().max().item()
    tiled_err = (tiled.double() - exact).abs().max().item()
    masked_err = (masked.double() - exact).abs().max().item()
    assert tiled.dtype == dtype and tiled_err <= masked_err + ulp, (tiled_err, masked_err)
    torch.testing.assert_close(tiled_lse.double(), exact_lse, atol=1e-2, rtol=1e-3)


def test_rows_that_see_no_key_and_bounds_past_the_keys():
    """Leading queries with bound 0 get (0, −inf); bounds above Lk see every key."""
    lq, lk = 2 * BOUND_TILE_QUERIES + 3, 150
    bound = (torch.arange(lq) - 40).clamp(min=0) * 2 // 3
    bound[-10:] = lk + 50
    q, k, v = _qkv(lq, lk, 4, 4, 8, torch.float64, seed=1)
    out, lse = attend(q, k, v, 0.5, kv_bound=bound)
    ref, ref_lse = _attend_math(q, k, v, 0.5, causal=False, kv_bound=bound.clamp(max=lk))
    assert torch.isneginf(lse[:41]).all() and (out[:41] == 0).all()
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)


def test_latent_values_as_a_prefix_of_the_keys():
    """MLA passes the values as the first Dv dims of the key (a view): the tiled path keeps it."""
    lq = BOUND_TILE_QUERIES + 60
    bound = _dcp_bound(lq, 11, 2, 0, 1)
    q, k, _ = _qkv(lq, int(bound.max()), 16, 1, 24, torch.float64, seed=2)
    v = k[..., :16]
    out, lse = attend(q, k, v, 0.2, kv_bound=bound)
    ref, ref_lse = _attend_math(q, k, v, 0.2, causal=False, kv_bound=bound)
    assert out.shape == (lq, 16, 16)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)


def test_a_bound_that_falls_keeps_the_masked_path():
    lq = BOUND_TILE_QUERIES + 8
    bound = torch.arange(lq).flip(0) + 1
    q, k, v = _qkv(lq, lq, 2, 1, 8, torch.float64, seed=3)
    assert not kernels.is_non_decreasing(bound)
    out, lse = attend(q, k, v, 0.5, kv_bound=bound)
    ref, ref_lse = _attend_math(q, k, v, 0.5, causal=False, kv_bound=bound)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
