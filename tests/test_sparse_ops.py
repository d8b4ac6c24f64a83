"""DSA ops: the sharded global top-k equals the dense one; paged indexer and sparse attention equal
plain-torch references; a by-hand loop over DCP ranks (shard, score, merge top-k, attend, merge by
LSE) equals dense sparse attention.

References share no code with the kernels: the dense top-k is Python's ``sorted`` with the key
``(−score, position)``; attention is :func:`dcpgraph.testing.reference.dense_attention` over the
selected keys; shards come from :func:`dcpgraph.testing.reference.shard_tokens`.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dcpgraph import layout
from dcpgraph.ops import sparse  # noqa: F401  (registers the ops)
from dcpgraph.ops.sparse_kernels import index_scores, merge_topk, select_topk
from dcpgraph.testing.reference import dense_attention, merge_by_hand, shard_tokens
from dcpgraph.testing.strategies import seeds

ops = torch.ops.dcpgraph
NEG_INF = float("-inf")


def dense_topk(row: list[float], k: int) -> list[int]:
    """Positions of the ``k`` best finite scores of ``row``: score descending, position ascending."""
    ranked = sorted((i for i, s in enumerate(row) if s != NEG_INF), key=lambda i: (-row[i], i))
    return ranked[:k] + [-1] * (k - len(ranked[:k]))


def _scores(seed: int, t: int, length: int, levels: int) -> torch.Tensor:
    """Scores from a few levels (many exact ties), some −inf (invisible keys)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, levels, (t, length), generator=gen).double()
    hidden = torch.rand(t, length, generator=gen) < 0.2
    return values.masked_fill(hidden, NEG_INF)


# -- the global top-k merge -------------------------------------------------------------------------
@given(seed=seeds(), shards=st.integers(1, 5), length=st.integers(0, 24), k=st.integers(1, 12),
       levels=st.integers(1, 4), tokens=st.integers(1, 3))
def test_merge_of_shard_topks_equals_dense_topk(seed, shards, length, k, levels, tokens):
    """Any partition of the keys (empty shards, shards smaller than k): per-shard top-k by the tie
    rule, global positions, all candidates merged → exactly the dense top-k, in the same order."""
    scores = _scores(seed, tokens, length, levels)
    gen = torch.Generator().manual_seed(seed + 1)
    owner = torch.randint(0, shards, (length,), generator=gen)
    values, positions = [], []
    for r in range(shards):
        mine = torch.nonzero(owner == r).flatten()  # increasing global positions
        vals, local = select_topk(scores[:, mine], k)
        glob = torch.where(local >= 0, mine[local.clamp(min=0)] if mine.numel() else local, -1)
        values.append(vals)
        positions.append(glob)
    merged = merge_topk(torch.stack(values), torch.stack(positions), k)
    for t in range(tokens):
        assert merged[t].tolist() == dense_topk(scores[t].tolist(), k)


@given(seed=seeds(), dcp=st.integers(1, 4), interleave=st.sampled_from([1, 2, 4]), length=st.integers(0, 30),
       k=st.integers(1, 10))
def test_merge_over_the_dcp_layout_equals_dense_topk(seed, dcp, interleave, length, k):
    """The same through :mod:`dcpgraph.layout` (the shards DCP really uses), mapping local indices
    to global with ``global_index`` as the compiled graph does."""
    scores = _scores(seed, 2, length, 3)
    values, positions = [], []
    for r in range(dcp):
        mine = torch.arange(length)[layout.owner(torch.arange(length), dcp, interleave) == r]
        vals, local = select_topk(scores[:, mine], k)
        glob = torch.where(local >= 0, layout.global_index(local, r, dcp, interleave), -1)
        values.append(vals)
        positions.append(glob)
    merged = ops.merge_topk(torch.stack(values), torch.stack(positions), k)
    for t in range(2):
        assert merged[t].tolist() == dense_topk(scores[t].tolist(), k)


def test_select_topk_pads_and_orders_ties_by_position():
    scores = torch.tensor([[1.0, 3.0, 1.0, NEG_INF, 3.0]])
    values, idx = select_topk(scores, 4)
    assert idx.tolist() == [[1, 4, 0, 2]] and values.tolist() == [[3.0, 3.0, 1.0, 1.0]]
    values, idx = select_topk(scores, 7)
    assert idx.tolist() == [[1, 4, 0, 2, -1, -1, -1]] and values[0, 4:].tolist() == [NEG_INF] * 3
    assert select_topk(scores[:, :0], 2)[1].tolist() == [[-1, -1]]


# -- paged kernels -----------------------------------------------------------------------------------
def _paged(x: torch.Tensor, block: int, blocks: int, gen) -> tuple[torch.Tensor, list[int]]:
    """``x [L, H, D]`` scattered into a shuffled paged cache; returns (cache, block table row)."""
    need = -(-x.shape[0] // block)
    table = torch.randperm(blocks, generator=gen)[:need].tolist()
    cache = torch.randn(blocks, block, *x.shape[1:], generator=gen, dtype=x.dtype)  # garbage elsewhere
    for j in range(x.shape[0]):
        cache[table[j // block], j % block] = x[j]
    return cache, table


def test_paged_indexer_topk_equals_dense_scores_and_topk():
    gen = torch.Generator().manual_seed(3)
    t, hi, d, length, block, k = 5, 4, 8, 13, 4, 6
    q = torch.randn(t, hi, d, generator=gen, dtype=torch.float64)
    w = torch.randn(t, hi, generator=gen, dtype=torch.float64)
    keys = torch.randn(length, 1, d, generator=gen, dtype=torch.float64)
    cache, row = _paged(keys, block, 8, gen)
    bound = torch.tensor([13, 12, 5, 1, 0])
    vals, idx = ops.paged_indexer_topk(q, w, cache, torch.tensor([row + [0]]), torch.tensor([0, t]), bound, 0.3, k)
    for i in range(t):
        # fp32 per head, as the model's indexer: Σ_h w_h·relu(0.3·q_h·k)
        dense = [float(sum(w[i, h].float() * torch.relu(0.3 * (q[i, h].float() @ keys[j, 0].float()))
                           for h in range(hi))) for j in range(int(bound[i]))]
        assert idx[i].tolist() == dense_topk(dense, k)
        chosen = [dense[j] for j in idx[i].tolist() if j >= 0]
        assert vals[i, :len(chosen)].tolist() == pytest.approx(chosen, rel=1e-5)


def test_paged_sparse_attention_equals_dense_over_the_selected_keys():
    gen = torch.Generator().manual_seed(4)
    t, h, d, dv, length, block = 4, 3, 10, 6, 11, 4
    q = torch.randn(t, h, d, generator=gen, dtype=torch.float64)
    kv = torch.randn(length, 1, d, generator=gen, dtype=torch.float64)
    cache, row = _paged(kv, block, 6, gen)
    indices = torch.tensor([[0, 5, 10, -1], [-1, -1, -1, -1], [3, -1, 2, 7], [9, 9, 1, -1]])
    out, lse = ops.paged_sparse_attention(q, cache, cache[..., :dv], torch.tensor([row]), torch.tensor([0, t]),
                                          indices, 0.25)
    for i in range(t):
        sel = sorted({j for j in indices[i].tolist() if j >= 0})
        if not sel:
            assert out[i].abs().max() == 0 and bool((lse[i] == NEG_INF).all())
            continue
        o, l_ = dense_attention(q[i:i + 1], kv[sel], kv[sel][..., :dv], 0.25)
        torch.testing.assert_close(out[i], o[0])
        torch.testing.assert_close(lse[i], l_[0])


@pytest.mark.parametrize(("dcp", "interleave"), [(2, 1), (3, 2), (4, 4)])
def test_by_hand_over_ranks_equals_dense_sparse_attention(dcp, interleave):
    """Per rank: its shard of both caches, local top-k, global positions; merge_topk of all ranks;
    each rank attends over the selected keys it owns; LSE merge by hand = dense attention over the
    dense top-k (queries at the last positions of a 14-token sequence; the first has an empty
    shard on some ranks)."""
    gen = torch.Generator().manual_seed(dcp * 10 + interleave)
    length, hi, di, h, d, dv, k = 14, 4, 8, 4, 12, 8, 5
    positions = torch.tensor([0, 7, 12, 13])
    q = torch.randn(len(positions), h, d, generator=gen, dtype=torch.float64)
    iq = torch.randn(len(positions), hi, di, generator=gen, dtype=torch.float64)
    w = torch.randn(len(positions), hi, generator=gen, dtype=torch.float64)
    ik = torch.randn(length, 1, di, generator=gen, dtype=torch.float64)
    kv = torch.randn(length, 1, d, generator=gen, dtype=torch.float64)
    values, globs, caches = [], [], []
    for r, (ik_r, kv_r) in enumerate(zip(shard_tokens(ik, dcp, interleave), shard_tokens(kv, dcp, interleave))):
        bound = layout.local_len(positions + 1, r, dcp, interleave)
        if ik_r.shape[0] == 0:
            ik_r, kv_r = ik[:1] * 0, kv[:1] * 0  # an empty shard still has a (unread) block
        table = torch.tensor([[0]])
        icache, kcache = ik_r.unsqueeze(0), kv_r.unsqueeze(0)  # one block holding the whole shard
        vals, idx = ops.paged_indexer_topk(iq, w, icache, table, torch.tensor([0, len(positions)]), bound, 0.5, k)
        values.append(vals)
        globs.append(torch.where(idx >= 0, layout.global_index(idx, r, dcp, interleave), -1))
        caches.append((kcache, table))
    selected = ops.merge_topk(torch.stack(values), torch.stack(globs), k)
    outs, lses = [], []
    for r, (kcache, table) in enumerate(caches):
        mine = (selected >= 0) & (layout.owner(selected, dcp, interleave) == r)
        local = torch.where(mine, layout.local_index(selected, dcp, interleave), -1)
        o, l_ = ops.paged_sparse_attention(q, kcache, kcache[..., :dv], table, torch.tensor([0, len(positions)]),
                                           local, 0.3)
        outs.append(o)
        lses.append(l_)
    out, lse = merge_by_hand(outs, lses)
    scores = index_scores(iq, ik[:, 0], w, 0.5)
    for i, p in enumerate(positions.tolist()):
        row = [float(x) for x in scores[i, : p + 1]]
        chosen = [j for j in dense_topk(row, k) if j >= 0]
        assert sorted(selected[i][selected[i] >= 0].tolist()) == sorted(chosen)
        o, l_ = dense_attention(q[i:i + 1], kv[chosen], kv[chosen][..., :dv], 0.3)
        torch.testing.assert_close(out[i], o[0])
        assert math.isclose(float(lse[i, 0]), float(l_[0, 0]), rel_tol=1e-9)


def test_canonical_ops_match_their_cached_forms():
    """``indexer_topk`` (HF layout, causal) = ``paged_indexer_topk`` with ``kv_bound = position + 1``;
    ``sparse_attention`` = ``paged_sparse_attention`` over one contiguous block."""
    gen = torch.Generator().manual_seed(5)
    s, hi, di, h, d = 9, 3, 8, 2, 6
    iq = torch.randn(1, s, hi, di, generator=gen, dtype=torch.float64)
    ik = torch.randn(1, s, di, generator=gen, dtype=torch.float64)
    w = torch.randn(1, s, hi, generator=gen, dtype=torch.float64)
    canon = ops.indexer_topk(iq, ik, w, 0.4, 3)
    _, paged = ops.paged_indexer_topk(iq[0], w[0], ik[0].view(1, s, 1, di), torch.tensor([[0]]),
                                      torch.tensor([0, s]), torch.arange(1, s + 1), 0.4, 3)
    assert torch.equal(canon[0], paged)
    q = torch.randn(1, h, s, d, generator=gen, dtype=torch.float64)
    kv = torch.randn(1, 1, s, d, generator=gen, dtype=torch.float64)
    out = ops.sparse_attention(q, kv, kv[..., :4], canon, 0.5)
    o, _ = ops.paged_sparse_attention(q[0].transpose(0, 1), kv[0].transpose(0, 1).view(1, s, 1, d),
                                      kv[0].transpose(0, 1).view(1, s, 1, d)[..., :4], torch.tensor([[0]]),
                                      torch.tensor([0, s]), canon[0], 0.5)
    torch.testing.assert_close(out[0].transpose(0, 1), o)
