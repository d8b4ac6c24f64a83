"""The native kernel's AMX-BF16 path (bf16 queries over bf16/fp8 KV caches) against fp32 attention.

The reference is the torch path (:func:`dcpgraph.ops.paged._paged_partial_attention_torch`) run in
fp32 on the same bf16 queries and the caches' exact values (fp8: dequantised by
:mod:`dcpgraph.ops.quant`). Stated accuracy (:data:`native.AMX_OUT_TOL`, :data:`native.AMX_LSE_TOL`):
the output carries the bf16 rounding of the softmax weights (the value product's operand), the
LSE only fp32 accumulation order. Skipped, with the reason, where the build or the OS has no AMX.
"""

from __future__ import annotations

import pytest
import torch

from dcpgraph.ops import native, paged

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
KV_DTYPES = [torch.bfloat16, torch.float8_e4m3fn]


def _amx_or_skip(kv_dtype):
    """Skip where this build, CPU or OS has no AMX path for ``kv_dtype``; fail where it has one
    that failed its self-check (a broken kernel must not read as a missing one)."""
    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.reason}")
    if not native.amx_enabled(kv_dtype):
        if native._amx_state.get(kv_dtype) is False:
            pytest.fail(f"the AMX path for {kv_dtype} failed its self-check: {native.amx_reason}")
        pytest.skip(f"AMX path off for {kv_dtype}: {native.amx_reason}")


@pytest.fixture(params=KV_DTYPES, ids=["bf16", "fp8"])
def kv_dtype(request, monkeypatch):
    monkeypatch.delenv("DCPGRAPH_NATIVE_AMX", raising=False)
    _amx_or_skip(request.param)
    return request.param


def _cache(seed, kv_dtype, nb, block, hkv, d, dv, prefix):
    """``(k, v, k_scales, v_scales)`` stored as ``kv_dtype`` and their exact fp32 values."""
    gen = torch.Generator().manual_seed(seed)
    k, ks, k_exact = paged._stored_as(2 * torch.randn(nb, block, hkv, d, generator=gen), kv_dtype)
    if prefix:
        v, vs, v_exact = k[..., :dv], None, k_exact[..., :dv]
    else:
        v, vs, v_exact = paged._stored_as(torch.randn(nb, block, hkv, dv, generator=gen), kv_dtype)
    return (k, v, ks, vs), (k_exact, v_exact)


def _check(kv_dtype, *, hq, hkv, d, dv, prefix=False, block=16, lens=(0, 5, 16, 37, 150), lq=1,
           chunk_tokens=None, seed=0):
    rows = len(lens)
    width = -(-max(lens) // block) + 1
    nb = rows * width + 3
    (k, v, ks, vs), (k_exact, v_exact) = _cache(seed, kv_dtype, nb, block, hkv, d, dv, prefix)
    gen = torch.Generator().manual_seed(seed + 1)
    table = torch.randperm(nb, generator=gen)[: rows * width].view(rows, width).to(torch.int32)  # scattered
    q = torch.randn(rows * lq, hq, d, generator=gen).to(torch.bfloat16)
    cu = torch.arange(rows + 1, dtype=torch.int32) * lq
    lens_t = torch.tensor(lens, dtype=torch.int32)
    ref_o, ref_l = paged._paged_partial_attention_torch(q.float(), k_exact, v_exact, table, cu, lens_t, None, 0.2)
    got = native.native_paged_decode(q, k, v, table, cu, lens_t, 0.2, k_scales=ks, v_scales=vs,
                                     chunk_tokens=chunk_tokens)
    assert got is not None
    out, lse = got
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and out.shape == ref_o.shape
    torch.testing.assert_close(out.float(), ref_o, atol=native.AMX_OUT_TOL, rtol=native.AMX_OUT_TOL)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_l))
    torch.testing.assert_close(lse, ref_l, atol=native.AMX_LSE_TOL, rtol=native.AMX_LSE_TOL)
    empty = [i for i, n in enumerate(lens) for _ in range(lq) if n == 0]
    assert torch.all(out[empty] == 0) and torch.all(lse[empty] == float("-inf"))
    return out, ref_o


@pytest.mark.parametrize("hq,hkv,d,dv", [
    (2, 2, 128, 128),  # g = 1
    (8, 2, 128, 128),  # g = 4
    (8, 1, 128, 128),  # g = 8
    (32, 1, 64, 64),  # g = 32: two query-row groups of 16
    (6, 3, 40, 24),  # widths off the 32-column tile grid: staged, zero padded
])
@pytest.mark.parametrize("block", [16, 32, 8])
def test_gqa_matches_fp32_reference(kv_dtype, hq, hkv, d, dv, block):
    _check(kv_dtype, hq=hq, hkv=hkv, d=d, dv=dv, block=block)


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("chunk_tokens", [None, 64])
def test_mla_values_read_from_the_latent_rows(kv_dtype, block, chunk_tokens):
    """MLA 576/512, 16 heads: values are the latent's first 512 columns (a prefix view)."""
    _check(kv_dtype, hq=16, hkv=1, d=576, dv=512, prefix=True, block=block, chunk_tokens=chunk_tokens,
           lens=(0, 1, 63, 64, 65, 200))


def test_verification_rows_of_several_queries(kv_dtype):
    """Three query tokens per request with g = 8: 24 query rows per KV head (two groups of 16)."""
    _check(kv_dtype, hq=8, hkv=1, d=128, dv=128, lq=3, lens=(0, 70, 129))


@pytest.mark.parametrize("chunk_tokens", [16, 48, 4096])
def test_split_k_chunks_merge(kv_dtype, chunk_tokens):
    _check(kv_dtype, hq=8, hkv=2, d=64, dv=64, chunk_tokens=chunk_tokens, lens=(3, 300, 0, 129))


def test_bad_block_table_falls_back_to_the_checked_path(kv_dtype):
    (k, v, ks, vs), _ = _cache(3, kv_dtype, 8, 16, 1, 64, 64, False)
    q = torch.randn(1, 4, 64).to(torch.bfloat16)
    table = torch.tensor([[0, 99]], dtype=torch.int32)  # 99: outside the cache's 8 blocks
    got = native.native_paged_decode(q, k, v, table, torch.tensor([0, 1]), torch.tensor([20]), 0.2,
                                     k_scales=ks, v_scales=vs)
    assert got is None


def test_dispatch_sends_bf16_queries_to_the_amx_path(kv_dtype, monkeypatch):
    """``paged_partial_attention`` hands bf16 queries to the kernel's AMX path (its ``amx`` flag,
    argument 10); fp32 queries go to its fp32 path."""
    if not paged.native_enabled(kv_dtype):
        pytest.skip(f"native {kv_dtype} off: {paged._native_state.get(('reason', kv_dtype))}")
    seen = []
    real = native._module.paged_attention
    monkeypatch.setattr(native._module, "paged_attention", lambda q, *a: seen.append((q.dtype, a[9])) or real(q, *a))
    (k, v, ks, vs), _ = _cache(4, kv_dtype, 12, 16, 1, 128, 128, False)
    table = torch.arange(12, dtype=torch.int32).view(2, 6)
    cu, lens = torch.arange(3, dtype=torch.int32), torch.tensor([40, 90], dtype=torch.int32)
    q = torch.randn(2, 8, 128)
    for dtype in (torch.bfloat16, torch.float32):
        paged.paged_partial_attention(q.to(dtype), k, v, table, cu, lens, None, 0.2, k_scales=ks, v_scales=vs)
    assert seen == [(torch.bfloat16, True), (torch.float32, False)]


def test_disabled_amx_falls_back_to_fp32_and_says_why(monkeypatch):
    """``DCPGRAPH_NATIVE_AMX=0``: bf16 queries take the fp32 path (bit for bit the kernel's result
    for the same queries in fp32, rounded once to bf16; within fp32 rounding of the torch path)
    and :data:`native.amx_reason` names the switch."""
    if not native.available() or torch.bfloat16 not in native.kv_dtypes():
        pytest.skip(f"native bf16 KV unavailable: {native.reason or native.kv_dtypes()}")
    monkeypatch.setenv("DCPGRAPH_NATIVE_AMX", "0")
    assert not native.amx_enabled(torch.bfloat16)
    assert "DCPGRAPH_NATIVE_AMX=0" in native.amx_reason
    (k, v, _, _), (k_exact, v_exact) = _cache(5, torch.bfloat16, 12, 16, 2, 64, 64, False)
    table = torch.arange(12, dtype=torch.int32).view(2, 6)
    cu, lens = torch.arange(3, dtype=torch.int32), torch.tensor([40, 90], dtype=torch.int32)
    q = torch.randn(2, 8, 64).to(torch.bfloat16)
    out, lse = native.native_paged_decode(q, k, v, table, cu, lens, 0.2)
    fp32_out, fp32_lse = native.native_paged_decode(q.float(), k, v, table, cu, lens, 0.2)
    assert torch.equal(out, fp32_out.to(torch.bfloat16)) and torch.equal(lse, fp32_lse)
    ref = paged._paged_partial_attention_torch(q.float(), k_exact, v_exact, table, cu, lens, None, 0.2)
    torch.testing.assert_close(fp32_out, ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref[1], atol=1e-5, rtol=1e-5)


def test_fp32_kv_is_not_an_amx_cache():
    assert not native.amx_enabled(torch.float32)
    assert "float32" in native.amx_reason


@pytest.mark.parametrize("latent", [False, True], ids=["gqa", "mla"])
def test_fp8_scales_that_are_not_powers_of_two(latent, monkeypatch):
    """A cache written elsewhere with arbitrary fp32 scales (``quantize_fp8`` writes powers of two).
    MLA's rows (several scale groups) are scaled while staged, in fp32 and rounded to bf16 once:
    what the torch path's dequantisation to bf16 gives, so it matches the reference read through
    that rounding. GQA's rows (one scale each) have their scales folded into the scores and the
    weights, with no rounding of the dequantised value: it matches the exact fp32 dequantisation
    (which differs from the bf16-rounded one by more than the tolerance here)."""
    monkeypatch.delenv("DCPGRAPH_NATIVE_AMX", raising=False)
    _amx_or_skip(torch.float8_e4m3fn)
    from dcpgraph.ops import quant

    gen = torch.Generator().manual_seed(7)
    nb, block, hq, d, dv = 12, 16, (16 if latent else 8), (576 if latent else 128), (512 if latent else 128)
    (k, v, ks, vs), _ = _cache(7, torch.float8_e4m3fn, nb, block, 1, d, dv, latent)
    odd = 1.0 + torch.rand(ks.shape, generator=gen)  # mantissas all over [1, 2)
    ks = ks * odd
    if not latent:
        vs = vs * (1.0 + torch.rand(vs.shape, generator=gen))
    assert torch.any(torch.frexp(ks)[0] != 0.5)
    read_as = torch.bfloat16 if latent else torch.float32
    k_ref = quant.dequantize_fp8(k, ks, read_as).float()
    v_ref = k_ref[..., :dv] if latent else quant.dequantize_fp8(v, vs, read_as).float()
    table = torch.randperm(nb, generator=gen).to(torch.int32).view(2, 6)
    cu, lens = torch.arange(3, dtype=torch.int32), torch.tensor([75, 96], dtype=torch.int32)
    q = torch.randn(2, hq, d, generator=gen).to(torch.bfloat16)
    ref_o, ref_l = paged._paged_partial_attention_torch(q.float(), k_ref, v_ref, table, cu, lens, None, 0.2)
    out, lse = native.native_paged_decode(q, k, v, table, cu, lens, 0.2, k_scales=ks, v_scales=None if latent else vs)
    torch.testing.assert_close(out.float(), ref_o, atol=native.AMX_OUT_TOL, rtol=native.AMX_OUT_TOL)
    torch.testing.assert_close(lse, ref_l, atol=native.AMX_LSE_TOL, rtol=native.AMX_LSE_TOL)


@pytest.mark.parametrize("d,dv,hq,latent", [(576, 512, 16, True), (256, 256, 8, False)], ids=["mla", "gqa-256"])
def test_fp8_nan_code_under_power_of_two_scales(d, dv, hq, latent, monkeypatch):
    """Rows of several scale groups (MLA's latent and rope; a 256-wide GQA head) are scaled while
    staged by an exponent step per group: the e4m3 NaN code (0x7F / 0xFF) under a finite power-of-
    two scale must stay NaN through that step, as the torch path's dequantisation has it: a NaN
    in a key makes its request's rows NaN, one only in a value row (GQA) its column (and, as
    everywhere on this path, that column's pair partner)."""
    monkeypatch.delenv("DCPGRAPH_NATIVE_AMX", raising=False)
    _amx_or_skip(torch.float8_e4m3fn)
    from dcpgraph.ops import quant

    (k, v, ks, vs), _ = _cache(11, torch.float8_e4m3fn, 8, 16, 1, d, dv, latent)
    k.view(torch.uint8)[1, 3, 0, d - 60] = 0x7F  # request 0 (blocks 0-3): key 19, in its last group
    if not latent:
        v.view(torch.uint8)[5, 2, 0, 200] = 0xFF  # request 1 (blocks 4-7): value 2 of block 5
    assert torch.all(torch.frexp(ks)[0] == 0.5)  # power-of-two scales: the stepped staging
    k_ref = quant.dequantize_fp8(k, ks, torch.float32)
    v_ref = k_ref[..., :dv] if latent else quant.dequantize_fp8(v, vs, torch.float32)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    cu, lens = torch.arange(3, dtype=torch.int32), torch.tensor([60, 64], dtype=torch.int32)
    q = torch.randn(2, hq, d, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    ref_o, ref_l = paged._paged_partial_attention_torch(q.float(), k_ref, v_ref, table, cu, lens, None, 0.2)
    out, lse = native.native_paged_decode(q, k, v, table, cu, lens, 0.2, k_scales=ks,
                                          v_scales=None if latent else vs)
    assert torch.isnan(ref_o[0]).all() and torch.isnan(ref_l[0]).all()
    # the value product reads a column pair per dword: a NaN value also makes its partner NaN
    pairs = torch.isnan(ref_o).view(2, hq, dv // 2, 2).any(-1, keepdim=True).expand(2, hq, dv // 2, 2)
    assert torch.equal(torch.isnan(out.float()), pairs.reshape(2, hq, dv))
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_l))
    clean = ~pairs.reshape(2, hq, dv)
    torch.testing.assert_close(out.float()[clean], ref_o[clean], atol=native.AMX_OUT_TOL, rtol=native.AMX_OUT_TOL)


@pytest.mark.parametrize("latent", [False, True], ids=["gqa", "mla"])
def test_fp8_every_byte_is_read_exactly(latent, monkeypatch):
    """Each request sees one key, so its softmax weight is exactly 1 and its output is that
    token's value row as the kernel read it: every finite e4m3 byte (subnormals and both zeros
    included) under power-of-two scales must come out as its exact dequantised value, bit for bit,
    whether the scale is folded into the weights (GQA) or applied while staging (MLA)."""
    monkeypatch.delenv("DCPGRAPH_NATIVE_AMX", raising=False)
    _amx_or_skip(torch.float8_e4m3fn)
    from dcpgraph.ops import quant

    hq, d, dv = (16, 576, 512) if latent else (8, 128, 128)
    codes = torch.arange(256, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0  # the two NaN codes
    codes = codes.to(torch.uint8)
    groups = -(-d // quant.FP8_SCALE_GROUP)
    k = torch.zeros(2, 16, 1, d, dtype=torch.uint8)
    v = torch.zeros(2, 16, 1, dv, dtype=torch.uint8)
    if latent:  # every code in the latent columns of both rows, in two orders
        k[0, 0, 0, :512] = torch.cat([codes, codes.flip(0)])
        k[1, 0, 0, :512] = torch.cat([codes.flip(0), codes])
    else:
        v[0, 0, 0], v[1, 0, 0] = codes[:128], codes[128:]
    k, v = k.view(torch.float8_e4m3fn), v.view(torch.float8_e4m3fn)
    powers = torch.tensor([-9.0, -3.0, 0.0, 4.0, 7.0])
    ks = torch.exp2(powers[torch.arange(2 * 16 * groups) % 5]).view(2, 16, 1, groups)
    vs = torch.exp2(powers.flip(0)[torch.arange(2 * 16) % 5]).view(2, 16, 1, 1)
    if latent:
        v, vs = k[..., :dv], None
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    cu, lens = torch.arange(3, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    q = torch.randn(2, hq, d, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    out, _ = native.native_paged_decode(q, k, v, table, cu, lens, 0.2, k_scales=ks, v_scales=vs)
    read = quant.dequantize_fp8(k, ks, torch.float32)[..., :dv] if latent else quant.dequantize_fp8(v, vs, torch.float32)
    expected = read[:, 0, 0].unsqueeze(1).expand(2, hq, dv)
    assert torch.equal(out.float(), expected)


def _bounded_case(kv_dtype, hq, hkv, d, dv, prefix, seed=11):
    """Two requests mid chunked prefill: 70 query tokens at the end of a 300-token context, and a
    fresh 40-token prompt; query token t sees keys j < bound[t] (causal), one row sees none."""
    gen = torch.Generator().manual_seed(seed)
    nb, block = 60, 16
    (k, v, ks, vs), (k_exact, v_exact) = _cache(seed, kv_dtype, nb, block, hkv, d, dv, prefix)
    table = torch.randperm(nb, generator=gen)[:60].view(2, 30).to(torch.int32)
    lens = torch.tensor([300, 40], dtype=torch.int32)
    cu = torch.tensor([0, 70, 110], dtype=torch.int32)
    bound = torch.cat([torch.arange(231, 301), torch.arange(1, 41)]).to(torch.int32)
    bound[5] = 0
    q = torch.randn(110, hq, d, generator=gen).to(torch.bfloat16)
    ref = paged._paged_partial_attention_torch(q.float(), k_exact, v_exact, table, cu, lens, bound, 0.2)
    return (q, k, v, ks, vs, table, cu, lens, bound), ref


@pytest.mark.parametrize("hq,hkv,d,dv,prefix", [(8, 2, 128, 128, False), (16, 1, 576, 512, True), (6, 3, 40, 24, False)],
                         ids=["gqa", "mla", "off-grid"])
@pytest.mark.parametrize("chunk_tokens", [None, 64])
def test_causal_chunk_rows_match_the_reference(kv_dtype, hq, hkv, d, dv, prefix, chunk_tokens):
    """A chunked prefill's context attention (per-token bounds) on the AMX path, keys split into
    items or not: within the path's tolerance of fp32 attention, a row bounded to no key (0, -inf)."""
    (q, k, v, ks, vs, table, cu, lens, bound), (ref_o, ref_l) = _bounded_case(kv_dtype, hq, hkv, d, dv, prefix)
    out, lse = native.native_paged_decode(q, k, v, table, cu, lens, 0.2, k_scales=ks, v_scales=vs,
                                          chunk_tokens=chunk_tokens, kv_bound=bound)
    torch.testing.assert_close(out.float(), ref_o, atol=native.AMX_OUT_TOL, rtol=native.AMX_OUT_TOL)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_l)) and torch.all(out[5] == 0)
    finite = torch.isfinite(ref_l)
    torch.testing.assert_close(lse[finite], ref_l[finite], atol=native.AMX_LSE_TOL, rtol=native.AMX_LSE_TOL)


@pytest.mark.parametrize("hq", [16, 4], ids=["row-groups", "packed-rows"])
def test_verification_rows_take_their_bounds_in_one_call(kv_dtype, hq, monkeypatch):
    """Speculative verification (1 + k queries a request, causal bounds) and decode rows in one
    batch, through ``paged_partial_attention`` with bf16 queries: one kernel call with the bounds
    (no one-row-per-query rewrite), within the AMX path's tolerance of fp32 attention. With 4
    query heads on 2 KV heads a request's 4 queries are 8 rows: the packed-rows path, whose
    two-token softmax masks each row's keys past its bound inside the last key group."""
    if not paged.native_enabled(kv_dtype):
        pytest.skip(f"native {kv_dtype} off: {paged._native_state.get(('reason', kv_dtype))}")
    gen = torch.Generator().manual_seed(21)
    nb, block, hkv, d = 40, 16, 2, 128
    (k, v, ks, vs), (k_exact, v_exact) = _cache(21, kv_dtype, nb, block, hkv, d, d, False)
    table = torch.randperm(nb, generator=gen)[:36].view(3, 12).to(torch.int32)
    lens = torch.tensor([150, 9, 191], dtype=torch.int32)
    cu = torch.tensor([0, 4, 5, 9], dtype=torch.int32)  # 1 + 3 drafts, a decode row, 1 + 3 drafts
    bound = torch.tensor([147, 148, 149, 150, 9, 188, 189, 190, 191], dtype=torch.int32)
    q = torch.randn(9, hq, d, generator=gen).to(torch.bfloat16)
    calls = []
    real = native._module.paged_attention
    monkeypatch.setattr(native._module, "paged_attention", lambda *a: calls.append((a[0].shape[0], a[8] is not None))
                        or real(*a))
    out, lse = paged.paged_partial_attention(q, k, v, table, cu, lens, bound, 0.2, k_scales=ks, v_scales=vs)
    assert calls == [(9, True)]
    ref_o, ref_l = paged._paged_partial_attention_torch(q.float(), k_exact, v_exact, table, cu, lens, bound, 0.2)
    torch.testing.assert_close(out.float(), ref_o, atol=native.AMX_OUT_TOL, rtol=native.AMX_OUT_TOL)
    torch.testing.assert_close(lse, ref_l, atol=native.AMX_LSE_TOL, rtol=native.AMX_LSE_TOL)


def test_long_bounded_rows_take_the_kernel_not_a_gathered_copy(kv_dtype, monkeypatch):
    """``paged_partial_attention`` hands a chunked prefill's bounded rows (more than
    MAX_BOUNDED_QUERIES_PER_ROW queries) with bf16 queries to the kernel with their bounds, and
    never calls the torch path; fp32 queries keep the torch path (the bound needs the AMX path)."""
    if not paged.native_enabled(kv_dtype):
        pytest.skip(f"native {kv_dtype} off: {paged._native_state.get(('reason', kv_dtype))}")
    args, (ref_o, _) = _bounded_case(kv_dtype, 8, 2, 128, 128, False)
    q, k, v, ks, vs, table, cu, lens, bound = args
    bounds_seen, torch_calls = [], []
    real_kernel, real_torch = native._module.paged_attention, paged._paged_partial_attention_torch
    monkeypatch.setattr(native._module, "paged_attention", lambda *a: bounds_seen.append(a[8] is not None) or real_kernel(*a))
    monkeypatch.setattr(paged, "_paged_partial_attention_torch", lambda *a, **kw: torch_calls.append(1) or real_torch(*a, **kw))
    out, _ = paged.paged_partial_attention(q, k, v, table, cu, lens, bound, 0.2, k_scales=ks, v_scales=vs)
    assert bounds_seen == [True] and torch_calls == []
    torch.testing.assert_close(out.float(), ref_o, atol=native.AMX_OUT_TOL, rtol=native.AMX_OUT_TOL)
    paged.paged_partial_attention(q.float(), k, v, table, cu, lens, bound, 0.2, k_scales=ks, v_scales=vs)
    assert torch_calls == [1]
    # the fp32 path takes bounds as one-query rows' lengths: rows of several bounded queries are not its
    assert native.native_paged_decode(q.float(), k, v, table, cu, lens, 0.2, k_scales=ks, v_scales=vs,
                                      kv_bound=bound) is None
