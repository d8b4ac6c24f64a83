"""The optional native paged-decode kernel (:mod:`dcpgraph.ops.native`) against the torch path.

The extension is built once into its persistent directory (``~/.cache/dcpgraph/native/<hash>``
or ``$DCPGRAPH_NATIVE_BUILD_DIR``) and reused by every later process; if it cannot be built on
this machine, every test here is skipped with the build's reason.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpgraph.ops import native, paged, quant

ATOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _built():
    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.reason}")


def _torch_path(*args):
    return paged._paged_partial_attention_torch(*args)


def _check(q, k_cache, v_cache, table, lens, scale=0.2, chunk_tokens=None):
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    lens = torch.tensor(lens, dtype=torch.int32)
    ref_o, ref_l = _torch_path(q, k_cache, v_cache, table, cu, lens, None, scale)
    got = native.native_paged_decode(q, k_cache, v_cache, table, cu, lens, scale, chunk_tokens=chunk_tokens)
    assert got is not None
    out, lse = got
    assert out.shape == ref_o.shape and lse.shape == ref_l.shape and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_o, atol=ATOL, rtol=ATOL)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_l))
    torch.testing.assert_close(lse, ref_l, atol=ATOL, rtol=ATOL)
    return out, lse


def _case(seed, nb, block, hkv, d, dv, hq, rows, width, prefix=False):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(nb, block, hkv, d, generator=gen)
    v_cache = k_cache[..., :dv] if prefix else torch.randn(nb, block, hkv, dv, generator=gen)
    table = torch.randperm(nb, generator=gen)[: rows * width].view(rows, width).to(torch.int32)
    q = torch.randn(rows, hq, d, generator=gen)
    return q, k_cache, v_cache, table


@pytest.mark.parametrize("hq,hkv", [(8, 1), (8, 2), (6, 3), (5, 5), (1, 1)])
def test_gqa_grouping_and_lengths(hq, hkv):
    # lengths 0, < one block, exactly one block, not a multiple of the block size; scattered ids
    q, k, v, table = _case(0, 64, 16, hkv, 40, 40, hq, 5, 10)
    out, lse = _check(q, k, v, table, [0, 5, 16, 37, 150])
    assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))


@settings(max_examples=40, deadline=None)
@given(g=st.integers(1, 20), hkv=st.integers(1, 2), tokens=st.lists(st.integers(1, 3), min_size=1, max_size=3),
       lens=st.lists(st.integers(0, 130), min_size=3, max_size=3), block=st.sampled_from([4, 16, 80]),
       shift=st.sampled_from([0.0, -200.0]), seed=st.integers(0, 2**16))
def test_any_rows_per_kv_head_and_any_length_match_the_torch_path(g, hkv, tokens, lens, block, shift, seed):
    """Every score-column stride (rows per KV head from 1 to 20: a few rows share a vector, or
    span several), context lengths that end anywhere in a vector, several query tokens per
    request, blocks over the softmax span (80), and queries whose every score is far below zero
    (a lane past the last column taken as 0 would become the max, and every weight exp(-87))."""
    gen = torch.Generator().manual_seed(seed)
    rows, d = len(tokens), 24
    nb = sum((n + block - 1) // block for n in lens[:rows]) + 1
    k = torch.randn(nb, block, hkv, d, generator=gen)
    v = torch.randn(nb, block, hkv, d, generator=gen)
    width = max(1, max((n + block - 1) // block for n in lens[:rows]))
    table = torch.randint(0, nb, (rows, width), generator=gen, dtype=torch.int32)
    cu = torch.tensor([0] + list(itertools.accumulate(tokens)), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), g * hkv, d, generator=gen)
    if shift:  # a query component along a key direction every key shares: all scores near shift
        k[..., 0] = 1.0
        q[..., 0] = shift / 0.2
    klens = torch.tensor(lens[:rows], dtype=torch.int32)
    ref = _torch_path(q, k, v, table, cu, klens, None, 0.2)
    got = native.native_paged_decode(q, k, v, table, cu, klens, 0.2)
    # scores near -200 carry fp32's absolute rounding there (~1e-5) into every weight; a wrong
    # max would be off by far more (every weight exp(-87), or an underflowed sum)
    tol = ATOL if not shift else 1e-3
    torch.testing.assert_close(got[0], ref[0], atol=tol, rtol=tol)
    assert torch.equal(torch.isinf(got[1]), torch.isinf(ref[1]))
    torch.testing.assert_close(got[1], ref[1], atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("chunk_tokens", [None, 16, 48, 4096])
def test_split_k_chunks(chunk_tokens):
    # a request split into several key chunks merged by LSE gives the same result as one chunk
    q, k, v, table = _case(1, 96, 8, 2, 32, 24, 8, 3, 30)
    _check(q, k, v, table, [233, 1, 96], chunk_tokens=chunk_tokens)


def test_mla_prefix_view_values():
    # MLA: values are a prefix view k_cache[..., :dv] of the latent (576/512-style, here 72/64)
    q, k, v, table = _case(2, 48, 16, 1, 72, 64, 16, 3, 12, prefix=True)
    assert v.data_ptr() == k.data_ptr()
    _check(q, k, v, table, [190, 7, 0])


def test_odd_block_size_and_head_dims():
    q, k, v, table = _case(3, 40, 5, 2, 19, 33, 6, 4, 9)
    _check(q, k, v, table, [44, 45, 3, 20])


def test_independent_of_block_placement():
    q, k, v, table = _case(4, 64, 16, 2, 64, 64, 8, 2, 16)
    lens = [250, 177]
    cu = torch.arange(3, dtype=torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    a = native.native_paged_decode(q, k, v, table, cu, lens_t, 0.1)
    # Move every block to a new physical id (a permutation), rewriting the table to match.
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(9))
    k2, v2 = torch.empty_like(k), torch.empty_like(v)
    k2[perm], v2[perm] = k, v
    b = native.native_paged_decode(q, k2, v2, perm[table.long()].to(torch.int32), cu, lens_t, 0.1)
    # contiguous placement too
    k3 = torch.cat([k[table[r].long()] for r in range(2)])
    v3 = torch.cat([v[table[r].long()] for r in range(2)])
    c = native.native_paged_decode(q, k3, v3, torch.arange(32, dtype=torch.int32).view(2, 16), cu, lens_t, 0.1)
    for other in (b, c):
        torch.testing.assert_close(other[0], a[0], atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(other[1], a[1], atol=ATOL, rtol=ATOL)


def test_several_query_rows_per_request():
    # no kv_bound: every query row of a request sees all of its keys
    q, k, v, table = _case(5, 32, 8, 2, 24, 24, 4, 5, 6)
    cu = torch.tensor([0, 2, 2, 5, 6, 7], dtype=torch.int32)
    lens = torch.tensor([30, 10, 0, 48, 9], dtype=torch.int32)
    qs = torch.randn(7, 4, 24, generator=torch.Generator().manual_seed(6))
    ref = _torch_path(qs, k, v, table, cu, lens, None, 0.3)
    got = native.native_paged_decode(qs, k, v, table, cu, lens, 0.3)
    torch.testing.assert_close(got[0], ref[0], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(got[1], ref[1], atol=ATOL, rtol=ATOL)


def test_dispatch_runs_bounded_multi_token_rows_natively(monkeypatch):
    """Speculative verification: rows of 1 + k queries with a causal kv_bound run the native kernel
    as one single-query row per token, equal to the torch path; prefill-sized rows do not."""
    q, k, v, table = _case(9, 64, 8, 2, 24, 24, 4, 3, 8)
    cu = torch.tensor([0, 4, 5, 9], dtype=torch.int32)
    lens = torch.tensor([40, 7, 63], dtype=torch.int32)
    bound = torch.tensor([37, 38, 39, 40, 7, 60, 61, 62, 63], dtype=torch.int32)
    qs = torch.randn(9, 4, 24, generator=torch.Generator().manual_seed(10))
    assert paged.native_enabled()  # its one-off self-check runs before the spy goes in
    calls = []
    real = native.native_paged_decode
    monkeypatch.setattr(native, "native_paged_decode", lambda *a, **kw: calls.append(a[3].shape[0]) or real(*a, **kw))
    got = paged.paged_partial_attention(qs, k, v, table, cu, lens, bound, 0.3)
    ref = _torch_path(qs, k, v, table, cu, lens, bound, 0.3)
    assert calls == [3, 9]  # refused with its rows of several queries, then one row per query token
    torch.testing.assert_close(got[0], ref[0], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(got[1], ref[1], atol=ATOL, rtol=ATOL)
    long_q = torch.randn(paged.MAX_BOUNDED_QUERIES_PER_ROW + 1, 4, 24)
    long_cu = torch.tensor([0, long_q.shape[0]], dtype=torch.int32)
    calls.clear()
    paged.paged_partial_attention(long_q, k, v, table[:1], long_cu, lens[:1], torch.arange(long_q.shape[0]) + 20, 0.3)
    assert calls == [1]  # refused (a row of several bounded queries), and too long to split into rows


def test_short_table_falls_back_and_raises():
    q, k, v, table = _case(7, 16, 4, 1, 16, 16, 2, 2, 3)
    cu = torch.arange(3, dtype=torch.int32)
    lens = torch.tensor([20, 4], dtype=torch.int32)  # 20 tokens need 5 blocks, the row has 3
    assert native.native_paged_decode(q, k, v, table, cu, lens, 0.1) is None
    with pytest.raises(ValueError, match="block table row"):
        paged.paged_partial_attention(q, k, v, table, cu, lens, None, 0.1)


def test_dispatch_uses_native_for_fp32_decode(monkeypatch):
    q, k, v, table = _case(8, 64, 16, 2, 32, 32, 4, 3, 12)
    cu = torch.arange(4, dtype=torch.int32)
    lens = torch.tensor([100, 0, 191], dtype=torch.int32)
    calls = []
    real = native.native_paged_decode
    monkeypatch.setattr(native, "native_paged_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    assert paged.native_enabled()
    out, lse = paged.paged_partial_attention(q, k, v, table, cu, lens, None, 0.25)
    assert calls
    ref = _torch_path(q, k, v, table, cu, lens, None, 0.25)
    torch.testing.assert_close(out, ref[0], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(lse, ref[1], atol=ATOL, rtol=ATOL)
    # decode with a kv_bound caps each row's length, in the kernel's one call
    bound = torch.tensor([50, 3, 191], dtype=torch.int32)
    calls.clear()
    got = paged.paged_partial_attention(q, k, v, table, cu, lens, bound, 0.25)
    assert calls == [1] and got is not None
    ref = _torch_path(q, k, v, table, cu, lens, bound, 0.25)
    torch.testing.assert_close(got[0], ref[0], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(got[1], ref[1], atol=ATOL, rtol=ATOL)
    monkeypatch.setenv("DCPGRAPH_NATIVE", "0")
    calls.clear()
    paged.paged_partial_attention(q, k, v, table, cu, lens, None, 0.25)
    assert not calls


# -- bf16 and fp8 KV caches: read as stored, converted in registers ---------------------------------
KV_DTYPES = [torch.bfloat16, torch.float8_e4m3fn]


def _typed(seed, kv_dtype, hq, hkv, d, dv, prefix, nb=64, block=16, rows=5, width=10):
    """A cache stored as ``kv_dtype`` and the exact fp32 values it holds (the reference's input)."""
    q, k, v, table = _case(seed, nb, block, hkv, d, dv, hq, rows, width, prefix)
    k_stored, k_scales, k_exact = paged._stored_as(3 * k, kv_dtype)
    if prefix:
        v_stored, v_scales, v_exact = k_stored[..., :dv], None, k_exact[..., :dv]
    else:
        v_stored, v_scales, v_exact = paged._stored_as(v, kv_dtype)
    return q, (k_stored, v_stored, k_scales, v_scales), (k_exact, v_exact), table


@pytest.fixture(params=KV_DTYPES, ids=["bf16", "fp8"])
def kv_dtype(request):
    if request.param not in native.kv_dtypes():
        pytest.skip(f"this native build reads {native.kv_dtypes()} only (bf16/fp8 need AVX-512 or AVX2 + FMA)")
    return request.param


@pytest.mark.parametrize("hq,hkv,d,dv,prefix", [
    (8, 1, 128, 128, False),  # GQA 8:1, one pass over each KV block for the group
    (8, 2, 40, 40, False),
    (16, 1, 576, 512, True),  # MLA: values are the latent's first 512 columns, read in place
    (6, 3, 19, 33, False),  # odd widths: masked tails
    (4, 2, 192, 128, False),  # K and V rows of different widths (2 and 1 fp8 scale groups)
])
@pytest.mark.parametrize("chunk_tokens", [None, 48])
def test_typed_kv_matches_reference_on_its_values(kv_dtype, hq, hkv, d, dv, prefix, chunk_tokens):
    q, (k, v, ks, vs), (k_exact, v_exact), table = _typed(10, kv_dtype, hq, hkv, d, dv, prefix)
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    lens = torch.tensor([0, 5, 16, 37, 150], dtype=torch.int32)
    ref = _torch_path(q, k_exact, v_exact, table, cu, lens, None, 0.2)
    out, lse = native.native_paged_decode(q, k, v, table, cu, lens, 0.2, k_scales=ks, v_scales=vs,
                                          chunk_tokens=chunk_tokens)
    tol = 1e-4 if d > 128 else ATOL
    torch.testing.assert_close(out, ref[0], atol=tol, rtol=tol)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref[1]))
    torch.testing.assert_close(lse, ref[1], atol=tol, rtol=tol)


@pytest.mark.parametrize("flush_denormal", [False, True], ids=["denormals", "daz"])
@pytest.mark.parametrize("rows", [1, 2], ids=["two-scales-a-row", "one-scale-a-row"])
def test_every_fp8_byte_decodes_exactly(flush_denormal, rows):
    """One key per request: the output is that key's value row, so it shows the in-register
    conversion of every finite e4m3fn byte (normals, subnormals, both zeros), times its scale.
    The fast conversion passes subnormals through fp32 denormals; a thread that treats denormal
    inputs as zero (``torch.set_flush_denormal(True)``, one thread so the kernel runs in it) takes
    the exact conversion instead. With one scale a row (``one-scale-a-row``: the 254 bytes as two
    rows of 127) the scale is applied to the softmax weights rather than to each element."""
    if flush_denormal and not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no denormal flushing to test (torch.set_flush_denormal returned False)")
    if torch.float8_e4m3fn not in native.kv_dtypes():
        pytest.skip(f"this native build reads {native.kv_dtypes()} only (fp8 needs AVX-512 or AVX2 + FMA)")
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # 254 values
    v = finite.view(torch.float8_e4m3fn).view(1, 1, rows, -1)  # one block, one slot, 1 or 2 heads
    scales = torch.tensor([0.5, 2.0]).view(1, 1, rows, -1)  # elements 0-127 and 128-253, or a row each
    k = torch.zeros(1, 1, rows, 16, dtype=torch.float8_e4m3fn)
    k_scales = torch.ones(1, 1, rows, 1)
    q = torch.zeros(1, rows, 16)
    one = torch.ones(1, dtype=torch.int32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.set_flush_denormal(flush_denormal)
        out, lse = native.native_paged_decode(q, k, v, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1]),
                                              one, 1.0, k_scales=k_scales, v_scales=scales)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    expected = quant.dequantize_fp8(v.view(1, rows, -1), scales.view(1, rows, -1), torch.float32).view(-1)
    assert torch.equal(out.view(-1), expected) and torch.equal(lse, torch.zeros_like(lse))


@pytest.mark.parametrize("q_times,k_times,v_times", [(1, 1, 1), (2e4, 1e-4, 1), (1, 1, 1e6)],
                         ids=["folded", "queries-past-the-fold-bound", "value-scales-past-the-fold-bound"])
def test_fp8_rows_of_one_scale_fold_only_where_the_products_stay_finite(q_times, k_times, v_times):
    """fp8 rows of one scale read as e4m3 * 2^-120 with 2^120 moved onto the queries and the
    softmax weights times V's scales; queries or V scales at or past 2^7 would overflow there, so
    those items and blocks take the scaled loader instead, whose 2^120 must not be multiplied into
    the scale first (-ffast-math did: inf for scales from 2^8 up). All three agree with fp32
    attention on the stored values."""
    if torch.float8_e4m3fn not in native.kv_dtypes():
        pytest.skip(f"this native build reads {native.kv_dtypes()} only (fp8 needs AVX-512 or AVX2 + FMA)")
    q, k, v, table = _case(13, 64, 16, 1, 128, 128, 8, 5, 10, False)
    (ks8, kss, k_exact), (vs8, vss, v_exact) = (paged._stored_as(x, torch.float8_e4m3fn)
                                                for x in (3 * k_times * k, v_times * v))
    q = q * q_times
    assert (q.abs().max() * 0.2 >= 128) == (q_times > 1) and (vss.max() >= 128) == (v_times > 1)
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    lens = torch.tensor([7, 150, 16, 0, 64], dtype=torch.int32)
    out, lse = native.native_paged_decode(q, ks8, vs8, table, cu, lens, 0.2, k_scales=kss, v_scales=vss)
    ref = _torch_path(q, k_exact, v_exact, table, cu, lens, None, 0.2)
    torch.testing.assert_close(out, ref[0], atol=ATOL * v_times, rtol=ATOL)
    torch.testing.assert_close(lse, ref[1], atol=ATOL, rtol=ATOL)


def test_bf16_queries_get_bf16_output_from_fp32_arithmetic(kv_dtype, monkeypatch):
    """With the AMX path off (tests/test_native_amx.py covers it), bf16 queries are computed in fp32."""
    monkeypatch.setenv("DCPGRAPH_NATIVE_AMX", "0")
    q, (k, v, ks, vs), (k_exact, v_exact), table = _typed(11, kv_dtype, 8, 2, 64, 64, False)
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    lens = torch.tensor([3, 70, 0, 16, 150], dtype=torch.int32)
    qb = q.bfloat16()
    out, lse = native.native_paged_decode(qb, k, v, table, cu, lens, 0.2, k_scales=ks, v_scales=vs)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref = _torch_path(qb.float(), k_exact, v_exact, table, cu, lens, None, 0.2)
    assert torch.equal(out, ref[0].bfloat16())  # fp32 result rounded once
    torch.testing.assert_close(lse, ref[1], atol=ATOL, rtol=ATOL)


def test_fp8_op_reads_the_cache_natively_not_through_a_dequantised_copy(monkeypatch):
    """``paged_attention`` on an fp8 cache calls the native kernel with the scales; the
    dequantise-into-a-compact-copy path is not taken (it would raise here)."""
    import dcpgraph.ops.library  # noqa: F401  (registers torch.ops.dcpgraph)
    from dcpgraph.ops import quant as quant_mod

    if not paged.native_enabled(torch.float8_e4m3fn):
        pytest.skip(f"native fp8 off: {paged._native_state.get(('reason', torch.float8_e4m3fn))}")
    q, (k, v, ks, vs), (k_exact, v_exact), table = _typed(12, torch.float8_e4m3fn, 8, 1, 128, 128, False)
    monkeypatch.setattr(quant_mod, "dequantized_context", lambda *a: pytest.fail("dequantised copy made"))
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    lens = torch.tensor([9, 0, 160, 33, 64], dtype=torch.int32)
    out, lse = torch.ops.dcpgraph.paged_attention(q, k, v, table, cu, lens, None, 0.2, k_scales=ks, v_scales=vs)
    ref = _torch_path(q, k_exact, v_exact, table, cu, lens, None, 0.2)
    torch.testing.assert_close(out, ref[0], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(lse, ref[1], atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("chunk_tokens", [None, 16], ids=["one-chunk", "split-k"])
@pytest.mark.parametrize(
    "kv_dtype,q_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
     (torch.float8_e4m3fn, torch.float32), (torch.float8_e4m3fn, torch.bfloat16)],
    ids=["fp32", "bf16-fp32q", "bf16-bf16q", "fp8-fp32q", "fp8-bf16q"],
)
def test_nan_in_the_cache_propagates_as_in_the_torch_path(kv_dtype, q_dtype, chunk_tokens, monkeypatch):
    """A NaN the model wrote into the cache is not hidden: a NaN key makes that request's outputs
    and LSEs NaN (its softmax row is NaN), a NaN value its outputs in that column NaN (LSE
    finite), as the torch path computes them; the other requests are unaffected. Every native path
    (fp32, fp32 queries over bf16/fp8 including the e4m3 NaN code, the AMX path for bf16 queries)
    and the split-K merge."""
    monkeypatch.delenv("DCPGRAPH_NATIVE_AMX", raising=False)
    gen = torch.Generator().manual_seed(9)
    nb, block, hkv, hq, d = 12, 16, 2, 8, 128
    k32 = torch.randn(nb, block, hkv, d, generator=gen)
    v32 = torch.randn(nb, block, hkv, d, generator=gen)
    k32[1, 5, 0, 17] = float("nan")  # request 0 (blocks 0-3), KV head 0: its key 21
    v32[6, 2, 1, 40] = float("nan")  # request 1 (blocks 4-7), KV head 1: its value 34
    if kv_dtype == torch.float8_e4m3fn:
        (k, ks, k_ref), (v, vs, v_ref) = (paged._stored_as(x, kv_dtype) for x in (k32, v32))
    else:
        k, v, ks, vs = k32.to(kv_dtype), v32.to(kv_dtype), None, None
        k_ref, v_ref = k.float(), v.float()
    table = torch.arange(nb, dtype=torch.int32).view(3, 4)
    cu, lens = torch.arange(4, dtype=torch.int32), torch.tensor([60, 64, 50], dtype=torch.int32)
    q = torch.randn(3, hq, d, generator=gen).to(q_dtype)
    ref_o, ref_l = _torch_path(q.float(), k_ref, v_ref, table, cu, lens, None, 0.2)
    got = native.native_paged_decode(q, k, v, table, cu, lens, 0.2, k_scales=ks, v_scales=vs,
                                     chunk_tokens=chunk_tokens)
    assert got is not None
    out, lse = got[0].float(), got[1]
    # the reference's pattern: request 0's KV head 0 rows all NaN; request 1's KV head 1 rows NaN
    # in the value's column (in its whole scale group for fp8), their LSE finite; request 2 clean
    assert torch.isnan(ref_o[0, :4]).all() and torch.isnan(ref_l[0, :4]).all()
    assert torch.isnan(ref_o[1, 4:, 40]).all() and not torch.isnan(ref_l[1:]).any()
    assert not torch.isnan(ref_o[0, 4:]).any() and not torch.isnan(ref_o[1, :4]).any() and not torch.isnan(ref_o[2]).any()
    expected = torch.isnan(ref_o)
    on_amx = q_dtype == torch.bfloat16 and native.amx_enabled(kv_dtype)
    if on_amx:
        # The AMX path's value product reads a column pair per dword and picks one column by a zero
        # weight on the other (paged_decode_amx.h), and 0 x NaN is NaN: a NaN value also reaches
        # its pair partner's output column. Nothing the reference has as NaN is hidden.
        expected = expected | expected.view(*expected.shape[:-1], -1, 2).flip(-1).reshape(expected.shape)
    assert torch.equal(torch.isnan(out), expected)
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_l))
    fine = ~expected
    # fp32 arithmetic is close to the reference; bf16 queries also get their output rounded to bf16
    tol = native.AMX_OUT_TOL if on_amx else 1 / 128 if q_dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out[fine], ref_o[fine], atol=tol, rtol=tol)
