"""Numerical tests of the canonical ops (``torch.ops.dcpgraph.*``; docs/architecture.md,
The merge and Attention in DCP form).

Every kernel result is compared with :mod:`dcpgraph.testing.reference`: float64 dense attention
(``softmax(scale·q·kᵀ)·v`` with GQA by ``repeat_interleave``) and a hand-written merge loop, none
of which shares code with the kernels. Hypothesis draws configurations and seeds; tensors come from
a seeded ``torch.Generator``.

1. sharded ``partial_attention`` + ``merge_attention`` == dense (fp32, 1e-5), empty shards included;
2. the same through per-rank paged caches written with ``slot_mapping`` + ``kv_cache_write_``, with
   and without the causal ``kv_bound`` of multi-token (speculative) queries;
3. causal varlen ``partial_attention`` == dense causal, row by row;
4. ``merge_attention``'s edge rules and algebra, and the base-2 LSE conversion;
5. bf16: sharded+merged error within 2× plain torch SDPA's error (FlashAttention's criterion);
6. ``rescale_to_global`` summed over ranks == ``merge_attention``;
7. fake kernels: ``torch.library.opcheck`` and a fake-mode trace of a whole DCP step.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

import dcpgraph.ops  # noqa: F401  (registers torch.ops.dcpgraph.*)
from dcpgraph import layout
from dcpgraph.ops import merge_attention, rescale_to_global
from dcpgraph.testing import strategies as dst
from dcpgraph.testing.reference import (
    dense_attention,
    merge_by_hand,
    shard_tokens,
    sharded_attention_by_hand,
)

ops = torch.ops.dcpgraph
NEG_INF = float("-inf")
ATOL = 1e-5  # fp32 ops vs the float64 reference
MERGE_TOL = {"atol": 1e-6, "rtol": 1e-6}  # two fp32 merges of the same partials: a few ulps


def _examples(n: int) -> int:
    """``n`` examples under the ``ci`` profile (50 by default, ~20 s for this file on 2 cores),
    scaled with the loaded profile's ``max_examples`` (``HYPOTHESIS_PROFILE=dev`` runs 10×)."""
    return max(1, n * settings.default.max_examples // 50)


# CPU-sized attention shapes: MLA (576/512 included), GQA/MQA/MHA with odd head dims.
CONFIGS = dst.attention_configs(max_q_heads=16, max_head_dim=576)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL) -> None:
    """``|actual − expected| <= atol`` elementwise (both ``−inf`` counts as equal), no NaN."""
    assert not torch.isnan(actual).any(), "NaN in the kernel result"
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=0)


def _requests(draw, dcp: int, interleave: int, max_length: int, max_q: int = 4):
    """1..3 requests: (context length, number of query tokens)."""
    n = draw(st.integers(1, 3))
    lens = [draw(dst.lengths(dcp, interleave, max_value=max_length)) for _ in range(n)]
    nq = [draw(st.integers(0 if n > 1 else 1, max_q)) for _ in range(n)]
    return lens, nq


def _events(cfg, lens, dcp=1, interleave=1) -> None:
    """Coverage labels for ``pytest --hypothesis-show-statistics``."""
    event(f"kind={cfg.kind}{' 576/512' if cfg.head_dim == 576 else ''}")
    event(f"longest context {'>= 1000' if max(lens) >= 1000 else '< 1000'}")
    if any(layout.local_len(n, dcp - 1, dcp, interleave) == 0 for n in lens):
        event("some shard empty")


def _scale(head_dim: int, sharp: bool) -> float:
    # 2x sharper softmax at most: at 3x even torch's own fp32 SDPA is ~4e-6 off float64 at
    # head dim 192, too close to the 1e-5 budget.
    return (2.0 if sharp else 1.0) / math.sqrt(head_dim)


# -- shared driver: shard contiguous K/V per rank, partial attention per rank, merge -------------
def _sharded_partial_merge(qs, ks, vs, scale, dcp, interleave):
    """Requests ``(q_i, k_i, v_i)`` → merged ``(out, lse)`` over the flattened query tokens."""
    q = torch.cat(qs)
    cu_q = _cu([x.shape[0] for x in qs])
    outs, lses = [], []
    for r in range(dcp):
        k_loc, v_loc, k_lens = [], [], []
        for k, v in zip(ks, vs):
            # Shard with the layout: token t → rank owner(t), slot local_index(t).
            t = torch.arange(k.shape[0])
            mine = layout.owner(t, dcp, interleave) == r
            n = layout.local_len(k.shape[0], r, dcp, interleave)
            assert int(mine.sum()) == n
            kr = k.new_full((n, *k.shape[1:]), math.nan)  # a slot left unfilled shows as NaN
            vr = v.new_full((n, *v.shape[1:]), math.nan)
            kr[layout.local_index(t[mine], dcp, interleave)] = k[mine]
            vr[layout.local_index(t[mine], dcp, interleave)] = v[mine]
            k_loc.append(kr)
            v_loc.append(vr)
            k_lens.append(n)
        o, lse = ops.partial_attention(
            q, torch.cat(k_loc), torch.cat(v_loc), cu_q, _cu(k_lens), scale, False
        )
        assert o.dtype == q.dtype and lse.dtype == torch.float32
        assert not torch.isnan(o).any() and not torch.isnan(lse).any(), f"NaN on rank {r}"
        outs.append(o)
        lses.append(lse)
    return merge_attention(torch.stack(outs), torch.stack(lses))


def _dense_per_request(qs, ks, vs, scale, positions=None):
    outs, lses = [], []
    for i, (q, k, v) in enumerate(zip(qs, ks, vs)):
        o, lse = dense_attention(
            q, k, v, scale, q_positions=None if positions is None else positions[i]
        )
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


# -- 1. sharded partial attention + merge == dense ----------------------------------------------
@settings(max_examples=_examples(50))
@given(
    data=st.data(), seed=dst.seeds(), cfg=CONFIGS, dcp=dst.dcp_sizes(), interleave=dst.interleaves()
)
def test_sharded_partial_attention_merge_equals_dense(data, seed, cfg, dcp, interleave):
    lens, nq = _requests(data.draw, dcp, interleave, max_length=3000)
    sharp = data.draw(st.booleans())
    note(f"{cfg=} {dcp=} {interleave=} {lens=} {nq=} {sharp=}")
    _events(cfg, lens, dcp, interleave)
    gen = _gen(seed)
    qs = [_randn(gen, t, cfg.num_q_heads, cfg.head_dim) for t in nq]
    ks = [_randn(gen, n, cfg.num_kv_heads, cfg.head_dim) for n in lens]
    vs = [_randn(gen, n, cfg.num_kv_heads, cfg.value_dim) for n in lens]
    scale = _scale(cfg.head_dim, sharp)

    out, lse = _sharded_partial_merge(qs, ks, vs, scale, dcp, interleave)
    ref_out, ref_lse = _dense_per_request(qs, ks, vs, scale)
    assert out.shape == ref_out.shape and out.dtype == torch.float32
    _assert_close(out, ref_out)
    _assert_close(lse, ref_lse)
    # The merged LSE is the log-sum-exp of the dense scores, computed directly.
    for i, (q, k) in enumerate(zip(qs, ks)):
        group = cfg.num_q_heads // cfg.num_kv_heads
        scores = scale * torch.einsum(
            "thd,shd->ths", q.double(), k.double().repeat_interleave(group, dim=1)
        )
        start = sum(nq[:i])
        _assert_close(lse[start : start + nq[i]], torch.logsumexp(scores, dim=-1))


def test_reference_shard_and_merge_by_hand_matches_dense():
    """The reusable hand reference agrees with dense attention (and uses empty shards)."""
    gen = _gen(7)
    q, k, v = _randn(gen, 3, 4, 24), _randn(gen, 37, 2, 24), _randn(gen, 37, 2, 20)
    for dcp, interleave in [(1, 1), (3, 1), (4, 4), (16, 8)]:
        shards = shard_tokens(k, dcp, interleave)
        assert [s.shape[0] for s in shards] == [
            layout.local_len(37, r, dcp, interleave) for r in range(dcp)
        ]
        out, lse = sharded_attention_by_hand(q, k, v, 0.3, dcp, interleave)
        ref_out, ref_lse = dense_attention(q, k, v, 0.3)
        torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=0)
        torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=0)
        pos = torch.tensor([0, 20, 36])
        out, lse = sharded_attention_by_hand(q, k, v, 0.3, dcp, interleave, q_positions=pos)
        ref_out, ref_lse = dense_attention(q, k, v, 0.3, q_positions=pos)
        torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=0)
        torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=0)


# -- 2. paged caches -----------------------------------------------------------------------------
def _paged_caches(ks, vs, dcp, interleave, block, gen, n_new):
    """Per-rank paged caches written through ``slot_mapping`` + ``kv_cache_write_``.

    The shared block table maps virtual blocks (``block·dcp`` tokens) to random physical blocks;
    unused cache slots hold NaN so a read past a request's local length shows up. The tokens are
    written in two steps: the context, then each request's last ``n_new[i]`` tokens (this step).
    """
    lens = [k.shape[0] for k in ks]
    virtual = block * dcp
    n_vblocks = [-(-n // virtual) for n in lens]
    width = max(max(n_vblocks), 1)
    num_blocks = sum(n_vblocks) + 2
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.full((len(lens), width), int(perm[-1]), dtype=torch.int32)  # padding: unused
    used = 0
    for i, nb in enumerate(n_vblocks):
        table[i, :nb] = perm[used : used + nb]
        used += nb
    hkv, d, dv = ks[0].shape[1], ks[0].shape[2], vs[0].shape[2]
    k_caches = [torch.full((num_blocks, block, hkv, d), math.nan) for _ in range(dcp)]
    v_caches = [torch.full((num_blocks, block, hkv, dv), math.nan) for _ in range(dcp)]
    for step in ("context", "new"):
        pos, rows, knew, vnew = [], [], [], []
        for i, (k, v) in enumerate(zip(ks, vs)):
            split = k.shape[0] - n_new[i]
            lo, hi = (0, split) if step == "context" else (split, k.shape[0])
            pos.append(torch.arange(lo, hi))
            rows.append(table[i].expand(hi - lo, width))
            knew.append(k[lo:hi])
            vnew.append(v[lo:hi])
        pos_t, rows_t = torch.cat(pos), torch.cat(rows)
        for r in range(dcp):
            slots = layout.slot_mapping(pos_t, rows_t, r, dcp, block, interleave)
            ops.kv_cache_write_(k_caches[r], torch.cat(knew), slots)
            ops.kv_cache_write_(v_caches[r], torch.cat(vnew), slots)
    return k_caches, v_caches, table


@settings(max_examples=_examples(40))
@given(
    data=st.data(),
    seed=dst.seeds(),
    cfg=CONFIGS,
    dcp=dst.dcp_sizes(),
    interleave=dst.interleaves(),
    causal=st.booleans(),
)
def test_paged_attention_merge_equals_dense(data, seed, cfg, dcp, interleave, causal):
    block = data.draw(dst.block_sizes(interleave, max_multiple=4))
    lens, nq = _requests(data.draw, dcp, interleave, max_length=2000)
    if causal:  # speculative decoding: the last nq tokens of each request are this step's queries
        nq = [min(t, n) for t, n in zip(nq, lens)]
    note(f"{cfg=} {dcp=} {interleave=} {block=} {lens=} {nq=} {causal=}")
    _events(cfg, lens, dcp, interleave)
    gen = _gen(seed)
    qs = [_randn(gen, t, cfg.num_q_heads, cfg.head_dim) for t in nq]
    ks = [_randn(gen, n, cfg.num_kv_heads, cfg.head_dim) for n in lens]
    vs = [_randn(gen, n, cfg.num_kv_heads, cfg.value_dim) for n in lens]
    scale = _scale(cfg.head_dim, data.draw(st.booleans()))
    n_new = nq if causal else [min(t, n) for t, n in zip(nq, lens)]
    k_caches, v_caches, table = _paged_caches(ks, vs, dcp, interleave, block, gen, n_new)

    q = torch.cat(qs)
    cu_q = _cu(nq)
    positions = [torch.arange(n - t, n) for t, n in zip(nq, lens)]  # global position per query
    pos_flat = torch.cat(positions)
    outs, lses = [], []
    for r in range(dcp):
        kv_lens = torch.tensor(
            [layout.local_len(n, r, dcp, interleave) for n in lens], dtype=torch.int32
        )
        bound = (
            layout.local_len(pos_flat + 1, r, dcp, interleave).to(torch.int32) if causal else None
        )
        o, lse = ops.paged_attention(
            q, k_caches[r], v_caches[r], table, cu_q, kv_lens, bound, scale
        )
        assert not torch.isnan(o).any() and not torch.isnan(lse).any(), f"NaN on rank {r}"
        outs.append(o)
        lses.append(lse)
    out, lse = merge_attention(torch.stack(outs), torch.stack(lses))
    ref_out, ref_lse = _dense_per_request(qs, ks, vs, scale, positions if causal else None)
    _assert_close(out, ref_out)
    _assert_close(lse, ref_lse)


def test_paged_attention_rejects_a_short_or_bad_block_table_row():
    """A row whose table cannot hold its local length is an error, not silently fewer keys."""
    gen = _gen(4)
    q, cache = _randn(gen, 1, 2, 8), _randn(gen, 6, 4, 2, 8)
    cu_q, kv_lens = _cu([1]), torch.tensor([8], dtype=torch.int32)
    for row, match in [([2], "block table row has 1"), ([2, -1], "outside"), ([2, 6], "outside")]:
        table = torch.tensor([row], dtype=torch.int32)
        with pytest.raises(ValueError, match=match):
            ops.paged_attention(q, cache, cache, table, cu_q, kv_lens, None, 0.3)
    # Padding past the blocks a row needs is never read.
    table = torch.tensor([[2, 3, -1]], dtype=torch.int32)
    out, lse = ops.paged_attention(q, cache, cache, table, cu_q, kv_lens, None, 0.3)
    ref_out, ref_lse = dense_attention(
        q, cache[2:4].reshape(8, 2, 8), cache[2:4].reshape(8, 2, 8), 0.3
    )
    _assert_close(out, ref_out)
    _assert_close(lse, ref_lse)


# -- 3. causal varlen partial attention ----------------------------------------------------------
@settings(max_examples=_examples(30))
@given(data=st.data(), seed=dst.seeds(), cfg=CONFIGS)
def test_causal_varlen_partial_attention_equals_dense(data, seed, cfg):
    n = data.draw(st.integers(1, 4))
    lk = [data.draw(st.integers(0, 300) | st.sampled_from([0, 1, 2, 64])) for _ in range(n)]
    # Square rows (prefill), fewer queries than keys (chunked prefill / spec decode), and more
    # queries than keys (the first rows then see nothing under bottom-right alignment).
    lq = [
        data.draw(st.sampled_from([k, min(k, 1), max(k - 3, 0), k + 2]) | st.integers(0, 8))
        for k in lk
    ]
    note(f"{cfg=} {lq=} {lk=}")
    _events(cfg, lk)
    gen = _gen(seed)
    qs = [_randn(gen, t, cfg.num_q_heads, cfg.head_dim) for t in lq]
    ks = [_randn(gen, s, cfg.num_kv_heads, cfg.head_dim) for s in lk]
    vs = [_randn(gen, s, cfg.num_kv_heads, cfg.value_dim) for s in lk]
    scale = _scale(cfg.head_dim, data.draw(st.booleans()))
    out, lse = ops.partial_attention(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), _cu(lq), _cu(lk), scale, True
    )
    positions = [torch.arange(s - t, s) for t, s in zip(lq, lk)]  # bottom-right alignment
    ref_out, ref_lse = _dense_per_request(qs, ks, vs, scale, positions)
    _assert_close(out, ref_out)
    _assert_close(lse, ref_lse)


@settings(max_examples=_examples(15))
@given(
    seed=dst.seeds(), cfg=CONFIGS, b=st.integers(1, 2), s=st.integers(1, 40), causal=st.booleans()
)
def test_attention_op_hf_layout_equals_dense(seed, cfg, b, s, causal):
    """``dcpgraph::attention`` ([B, H, S, D], causal top-left with Sq == Sk) == dense."""
    gen = _gen(seed)
    q = _randn(gen, b, cfg.num_q_heads, s, cfg.head_dim)
    k = _randn(gen, b, cfg.num_kv_heads, s, cfg.head_dim)
    v = _randn(gen, b, cfg.num_kv_heads, s, cfg.value_dim)
    scale = _scale(cfg.head_dim, False)
    out = ops.attention(q, k, v, scale, causal)
    assert out.shape == (b, cfg.num_q_heads, s, cfg.value_dim) and out.is_contiguous()
    for i in range(b):
        ref, _ = dense_attention(
            q[i].transpose(0, 1),
            k[i].transpose(0, 1),
            v[i].transpose(0, 1),
            scale,
            q_positions=torch.arange(s) if causal else None,
        )
        _assert_close(out[i].transpose(0, 1), ref)


# -- 4. merge_attention: edge rules and algebra --------------------------------------------------
def _partials(seed, n, rows=5, heads=3, dim=7, dtype=torch.float32):
    gen = _gen(seed)
    outs = _randn(gen, n, rows, heads, dim, dtype=dtype)
    lses = 4 * torch.randn(n, rows, heads, generator=gen)
    return outs, lses


def test_merge_empty_shard_with_nan_output_contributes_nothing():
    outs, lses = _partials(0, 3)
    ref_out, ref_lse = merge_attention(outs, lses)
    for at in range(4):
        o = torch.cat([outs[:at], torch.full_like(outs[:1], math.nan), outs[at:]])
        lse = torch.cat([lses[:at], torch.full_like(lses[:1], NEG_INF), lses[at:]])
        out, merged = merge_attention(o, lse)
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out, ref_out, **MERGE_TOL)
        torch.testing.assert_close(merged, ref_lse, **MERGE_TOL)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_merge_nan_or_pos_inf_lse_counts_as_empty(bad):
    outs, lses = _partials(1, 4)
    outs_bad = outs.clone()
    outs_bad[2] = 1e30  # garbage output of the broken shard: must not leak either
    lses_bad = lses.clone()
    lses_bad[2] = bad
    lses_bad[0, 1, 2] = bad  # and a single broken entry elsewhere
    out, lse = merge_attention(outs_bad, lses_bad)
    keep = torch.tensor([0, 1, 3])
    ref_out, ref_lse = merge_attention(outs[keep], lses[keep])
    ref_lse[1, 2] = torch.logsumexp(lses[[1, 3], 1, 2], 0)
    ref_out[1, 2] = merge_attention(outs[[1, 3], 1, 2], lses[[1, 3], 1, 2])[0]
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out, ref_out, **MERGE_TOL)
    torch.testing.assert_close(lse, ref_lse, **MERGE_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_merge_all_shards_empty_gives_exact_zero_and_neg_inf(dtype):
    outs = torch.full((4, 2, 3, 5), math.nan, dtype=dtype)
    outs[1] = 7
    lses = torch.tensor([NEG_INF, math.nan, math.inf, NEG_INF]).view(4, 1, 1).expand(4, 2, 3)
    out, lse = merge_attention(outs, lses)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(out, torch.zeros(2, 3, 5, dtype=dtype))
    assert not torch.signbit(out).any()  # +0, not −0
    assert torch.equal(lse, torch.full((2, 3), NEG_INF))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lse_dtype", [torch.float32, torch.bfloat16])
def test_merge_keeps_output_dtype_and_accumulates_in_fp32(dtype, lse_dtype):
    outs, lses = _partials(2, 64, dtype=dtype)
    lses = torch.zeros_like(lses).to(lse_dtype)  # equal weights: 64 terms of similar size
    out, lse = merge_attention(outs, lses)
    assert out.dtype == dtype and lse.dtype == torch.float32
    # fp32 accumulation: exactly the fp32 merge of the same (upcast) inputs, rounded once.
    ref_out, ref_lse = merge_attention(outs.float(), lses.float())
    assert torch.equal(out, ref_out.to(dtype))
    assert torch.equal(lse, ref_lse)
    if dtype != torch.float32:
        # A merge that accumulates in the low precision would be caught by this test.
        acc = torch.zeros_like(outs[0])
        for o in outs:
            acc = acc + (o / 64).to(dtype)
        assert not torch.equal(acc, out)


@settings(max_examples=_examples(25))
@given(seed=dst.seeds(), n=st.integers(1, 12), data=st.data())
def test_merge_algebra(seed, n, data):
    outs, lses = _partials(seed, n)
    # Some empty entries (−inf with NaN output), including whole empty shards.
    gen = _gen(seed + 1)
    empty = torch.rand(lses.shape, generator=gen) < 0.3
    if data.draw(st.booleans()):
        empty[0] = True
    lses = lses.masked_fill(empty, NEG_INF)
    outs = outs.masked_fill(empty.unsqueeze(-1), math.nan)
    out, lse = merge_attention(outs, lses)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    hand_out, hand_lse = merge_by_hand(list(outs), list(lses))
    torch.testing.assert_close(out.double(), hand_out, **MERGE_TOL)
    torch.testing.assert_close(lse.double(), hand_lse, **MERGE_TOL)

    # Associativity: merging the merges of any split equals one merge.
    cut = data.draw(st.integers(0, n))
    if 0 < cut < n:
        a = merge_attention(outs[:cut], lses[:cut])
        b = merge_attention(outs[cut:], lses[cut:])
        tree = merge_attention(torch.stack([a[0], b[0]]), torch.stack([a[1], b[1]]))
        torch.testing.assert_close(tree[0], out, **MERGE_TOL)
        torch.testing.assert_close(tree[1], lse, **MERGE_TOL)
    # Permutation invariance.
    perm = torch.randperm(n, generator=gen)
    p_out, p_lse = merge_attention(outs[perm], lses[perm])
    torch.testing.assert_close(p_out, out, **MERGE_TOL)
    torch.testing.assert_close(p_lse, lse, **MERGE_TOL)
    # Identity element (0, −inf), also with a NaN output: merging it changes nothing.
    for fill in (0.0, math.nan):
        ident_o = torch.full_like(out, fill).unsqueeze(0)
        ident_l = torch.full_like(lse, NEG_INF).unsqueeze(0)
        i_out, i_lse = merge_attention(
            torch.cat([out.unsqueeze(0), ident_o]), torch.cat([lse.unsqueeze(0), ident_l])
        )
        torch.testing.assert_close(i_out, out, **MERGE_TOL)
        torch.testing.assert_close(i_lse, lse, atol=0, rtol=0)
    # A single partial merges to itself (empty rows become exactly 0).
    s_out, s_lse = merge_attention(outs[:1], lses[:1])
    torch.testing.assert_close(s_lse, lses[0], atol=0, rtol=0)
    expected = torch.where(empty[0].unsqueeze(-1), 0.0, outs[0])
    torch.testing.assert_close(s_out, expected, **MERGE_TOL)


def test_merge_base2_lse_must_be_converted_to_natural_log():
    """A kernel that reports ``log2`` of the softmax denominator (FlashInfer-style) is merged
    exactly once its LSE is converted: ``lse_e = lse_2 · ln 2``; mixing bases is wrong."""
    gen = _gen(3)
    q, k, v = _randn(gen, 4, 4, 32), _randn(gen, 50, 2, 32), _randn(gen, 50, 2, 32)
    scale = 1 / math.sqrt(32)
    dcp = 4
    ks, vs = shard_tokens(k, dcp, 2), shard_tokens(v, dcp, 2)
    outs, lses2 = [], []
    for kr, vr in zip(ks, vs):
        o, lse = ops.partial_attention(q, kr, vr, _cu([4]), _cu([kr.shape[0]]), scale, False)
        outs.append(o)
        lses2.append(lse / math.log(2))  # what a base-2 kernel would return
    ref_out, ref_lse = dense_attention(q, k, v, scale)
    out, lse = merge_attention(torch.stack(outs), torch.stack(lses2) * math.log(2))
    _assert_close(out, ref_out)
    _assert_close(lse, ref_lse)
    wrong, _ = merge_attention(torch.stack(outs), torch.stack(lses2))
    assert (wrong.double() - ref_out).abs().max() > 1e-3


def test_merge_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="merge_attention"):
        merge_attention(torch.zeros(2, 3, 4), torch.zeros(2, 4))


# -- 5. bf16 -------------------------------------------------------------------------------------
@settings(max_examples=_examples(25))
@given(
    data=st.data(), seed=dst.seeds(), cfg=CONFIGS, dcp=dst.dcp_sizes(), interleave=dst.interleaves()
)
def test_bf16_sharded_error_within_twice_torch_sdpa(data, seed, cfg, dcp, interleave):
    """FlashAttention's criterion: ``max|out − ref| <= 2·max|out_pt − ref| + eps`` where ``ref`` is
    fp32 attention of the bf16-rounded inputs and ``out_pt`` torch's own bf16 SDPA."""
    # >= 2 keys: one key gives out = v exactly, and no key is test 1's business.
    length = data.draw(dst.lengths(dcp, interleave, max_value=2000).map(lambda n: n + 2))
    t = data.draw(st.integers(1, 4))
    note(f"{cfg=} {dcp=} {interleave=} {length=} {t=}")
    _events(cfg, [length], dcp, interleave)
    gen = _gen(seed)
    q = _randn(gen, t, cfg.num_q_heads, cfg.head_dim, dtype=torch.bfloat16)
    k = _randn(gen, length, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
    v = _randn(gen, length, cfg.num_kv_heads, cfg.value_dim, dtype=torch.bfloat16)
    scale = 1 / math.sqrt(cfg.head_dim)

    out, lse = _sharded_partial_merge([q], [k], [v], scale, dcp, interleave)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref, ref_lse = dense_attention(q.float(), k.float(), v.float(), scale)
    group = cfg.num_q_heads // cfg.num_kv_heads
    out_pt = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(group, dim=1).transpose(0, 1),
        v.repeat_interleave(group, dim=1).transpose(0, 1),
        scale=scale,
    ).transpose(0, 1)
    err = (out.double() - ref).abs().max().item()
    err_pt = (out_pt.double() - ref).abs().max().item()
    # eps: one bf16 ulp at the output's scale. Torch's SDPA here computes in fp32 and rounds once,
    # so with few output elements its max error can be ~0 by luck, while the sharded path rounds
    # each partial to bf16 and then the merge: ~1 ulp. Bf16 accumulation over a long context or
    # a lost partial is many ulps and still fails.
    scale_pow2 = 2.0 ** math.floor(math.log2(ref.abs().max().item()))
    eps = torch.finfo(torch.bfloat16).eps * scale_pow2
    note(f"{err=} {err_pt=} {eps=}")
    event(f"error <= {math.ceil(2 * err / eps) / 2} bf16 ulp")
    assert err <= 2 * err_pt + eps
    _assert_close(lse, ref_lse, atol=1e-4)  # the LSE is fp32 even for bf16 inputs


# -- 6. rescale_to_global ------------------------------------------------------------------------
@settings(max_examples=_examples(25))
@given(
    seed=dst.seeds(), n=st.integers(1, 16), dtype=st.sampled_from([torch.float32, torch.bfloat16])
)
def test_rescale_to_global_sums_to_merge(seed, n, dtype):
    outs, lses = _partials(seed, n, dtype=dtype)
    gen = _gen(seed + 1)
    empty = torch.rand(lses.shape, generator=gen) < 0.3
    empty[:, 0, 0] = True  # one row empty on every rank
    lses = lses.masked_fill(empty, NEG_INF)
    outs = outs.masked_fill(empty.unsqueeze(-1), math.nan)
    ref_out, ref_lse = merge_attention(outs.float(), lses)
    total = torch.zeros(outs.shape[1:])
    for r in range(n):
        scaled, lse_g = rescale_to_global(outs[r], lses[r], lses)
        assert scaled.dtype == torch.float32 and lse_g.dtype == torch.float32
        assert not torch.isnan(scaled).any()
        assert torch.equal(lse_g, ref_lse)
        total += scaled
    torch.testing.assert_close(total, ref_out, **MERGE_TOL)
    assert torch.equal(total[0, 0], torch.zeros_like(total[0, 0]))


# -- 7. fake kernels -----------------------------------------------------------------------------
def _op_samples():
    """Small real inputs for every op (empty shards and −1 slots included)."""
    gen = _gen(11)
    q, k, v = _randn(gen, 5, 4, 8), _randn(gen, 9, 2, 8), _randn(gen, 9, 2, 6)
    cu_q = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 6], dtype=torch.int32)
    k_cache, v_cache = _randn(gen, 6, 4, 2, 8), _randn(gen, 6, 4, 2, 6)
    table = torch.tensor([[3, 1], [0, 5], [2, 4]], dtype=torch.int32)
    kv_lens = torch.tensor([6, 0, 3], dtype=torch.int32)
    kv_bound = torch.tensor([2, 6, 1, 2, 3], dtype=torch.int32)
    outs, lses = _partials(12, 3)
    lses[1, 0] = NEG_INF
    slots = torch.tensor([4, -1, 17, 9, -1], dtype=torch.int64)
    bq, bk, bv = _randn(gen, 2, 4, 6, 8), _randn(gen, 2, 4, 6, 8), _randn(gen, 2, 4, 6, 8)
    return {
        "attention": [
            (bq, bk, bv, 0.35, True),
            (bq, bk, bv, 0.35, False),
            (bq.bfloat16(), bk.bfloat16(), bv.bfloat16(), 0.35, True),
            (bq, bk, bv, 0.35, True, 3, 2.5, _randn(gen, 4)),  # window, soft-cap, sinks
        ],
        "partial_attention": [
            (q, k, v, cu_q, cu_k, 0.3, False),
            (q, k, v, cu_q, cu_k, 0.3, True),
            (q.bfloat16(), k.bfloat16(), v.bfloat16(), cu_q, cu_k, 0.3, True),  # LSE stays fp32
            (q, k, v, cu_q, cu_k, 0.3, True, 2, 1.5),  # window, soft-cap
        ],
        "paged_attention": [
            (q, k_cache, v_cache, table, cu_q, kv_lens, None, 0.3),
            (q, k_cache, v_cache, table, cu_q, kv_lens, kv_bound, 0.3),
            (q.half(), k_cache.half(), v_cache.half(), table, cu_q, kv_lens, kv_bound, 0.3),
            (q, k_cache, v_cache, table, cu_q, kv_lens, kv_bound, 0.3, kv_bound // 2, 1.5),  # window start, cap
        ],
        "merge_attention": [(outs, lses), (outs.bfloat16(), lses)],
        "rescale_to_global": [(outs[0], lses[0], lses), (outs[1].bfloat16(), lses[1], lses)],
        "kv_cache_write_": [(k_cache.clone(), _randn(gen, 5, 2, 8), slots)],
    }


@pytest.mark.parametrize("name", sorted(_op_samples()))
def test_opcheck(name):
    for args in _op_samples()[name]:
        # All of opcheck's checks (schema, autograd registration, fake tensor, AOT dispatch with
        # dynamic shapes) pass: the fakes never look at data, and the real kernels' data-dependent
        # ``tolist()`` calls run only on real tensors.
        torch.library.opcheck(getattr(ops, name).default, args)


@pytest.mark.parametrize("name", sorted(_op_samples()))
def test_fake_kernels_match_real_metadata(name):
    from torch._subclasses.fake_tensor import FakeTensorMode

    for args in _op_samples()[name]:
        real = getattr(ops, name)(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        with FakeTensorMode() as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fake = getattr(ops, name)(*fake_args)
        real = real if isinstance(real, tuple) else (real,)
        fake = fake if isinstance(fake, tuple) else (fake,)
        for r, f in zip(real, fake, strict=True):
            if r is None:
                assert f is None
                continue
            assert (f.shape, f.dtype, f.stride()) == (r.shape, r.dtype, r.stride())


def test_dcp_step_traces_with_fake_tensors():
    """A whole DCP decode step (cache write, paged partial attention per rank, merge) traces in
    fake mode with symbolic shapes, so graphs built from these ops can be compiled."""
    from torch.fx.experimental.proxy_tensor import make_fx

    dcp, interleave, block = 2, 2, 4

    def step(q, k_new, v_new, positions, table, kv_lens0, kv_lens1, cu_q, kc0, vc0, kc1, vc1):
        outs, lses = [], []
        for r, (kc, vc, lens) in enumerate([(kc0, vc0, kv_lens0), (kc1, vc1, kv_lens1)]):
            slots = layout.slot_mapping(
                positions, table[:1].expand(positions.shape[0], -1), r, dcp, block, interleave
            )
            ops.kv_cache_write_(kc, k_new, slots)
            ops.kv_cache_write_(vc, v_new, slots)
            o, lse = ops.paged_attention(q, kc, vc, table, cu_q, lens, None, 0.25)
            outs.append(o)
            lses.append(lse)
        return ops.merge_attention(torch.stack(outs), torch.stack(lses))

    gen = _gen(5)
    args = (
        _randn(gen, 3, 4, 8),
        _randn(gen, 3, 2, 8),
        _randn(gen, 3, 2, 8),
        torch.tensor([5, 6, 7]),
        torch.tensor([[1, 0]], dtype=torch.int32),
        torch.tensor([4], dtype=torch.int32),
        torch.tensor([4], dtype=torch.int32),
        torch.tensor([0, 3], dtype=torch.int32),
        *[torch.zeros(2, block, 2, 8) for _ in range(4)],
    )
    gm = make_fx(step, tracing_mode="symbolic")(*args)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert {"dcpgraph.paged_attention.default", "dcpgraph.merge_attention.default"} <= targets
    assert "dcpgraph.kv_cache_write_.default" in targets
    real = step(*[a.clone() for a in args])
    traced = gm(*[a.clone() for a in args])
    for r, t in zip(real, traced):
        torch.testing.assert_close(r, t, atol=0, rtol=0)


def test_paged_attention_with_values_as_a_prefix_view_of_keys():
    """MLA's latent cache: values are ``cache[..., :R]``; the kernel's view path (one gather,
    flash with the key as value) must equal the math path on a separate value tensor."""
    gen = torch.Generator().manual_seed(3)
    blocks, block, rank, rope, heads = 6, 4, 12, 4, 5
    cache = torch.randn(blocks, block, 1, rank + rope, generator=gen, dtype=torch.float64)
    q = torch.randn(3, heads, rank + rope, generator=gen, dtype=torch.float64)
    table = torch.tensor([[4, 1, 5], [0, 2, 3]], dtype=torch.int32)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    lens = torch.tensor([10, 7], dtype=torch.int32)
    view = cache[..., :rank]
    out, lse = torch.ops.dcpgraph.paged_attention(q, cache, view, table, cu, lens, None, 0.3)
    ref_out, ref_lse = torch.ops.dcpgraph.paged_attention(q, cache, view.contiguous(), table, cu, lens, None, 0.3)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)


@pytest.mark.parametrize("value_prefix", [False, True])
def test_batched_decode_path_equals_per_request_loop(monkeypatch, value_prefix):
    """Decode batches (one query per row) take a batched gather path; it must equal the
    per-request streaming path exactly in fp64, empty rows included."""
    from dcpgraph.ops import paged

    gen = torch.Generator().manual_seed(11)
    blocks, block, hkv, d, hq = 10, 4, 2, 8, 6
    k_cache = torch.randn(blocks, block, hkv, d, generator=gen, dtype=torch.float64)
    v_cache = k_cache[..., :5] if value_prefix else torch.randn(blocks, block, hkv, 5, generator=gen, dtype=torch.float64)
    q = torch.randn(4, hq, d, generator=gen, dtype=torch.float64)
    table = torch.tensor([[7, 2, 9], [0, 1, 3], [4, 0, 0], [5, 6, 8]], dtype=torch.int32)
    cu = torch.arange(5, dtype=torch.int32)
    lens = torch.tensor([11, 5, 0, 12], dtype=torch.int32)
    batched = paged.paged_partial_attention(q, k_cache, v_cache, table, cu, lens, None, 0.4)
    monkeypatch.setattr(paged, "BATCHED_DECODE_TOKENS", 0)
    looped = paged.paged_partial_attention(q, k_cache, v_cache, table, cu, lens, None, 0.4)
    torch.testing.assert_close(batched[0], looped[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(batched[1], looped[1], rtol=0, atol=1e-12)
    assert torch.equal(batched[0][2], torch.zeros_like(batched[0][2])) and bool((batched[1][2] == float("-inf")).all())
