"""The CPU-checkable parts of the DSA lowering for Ascend (``backends/npu/rules_sparse``): the
GE-friendly ``merge_topk`` (two ``topk``s, no stable sort) selects exactly the tie rule's set, and
the softmax max/sum → LSE conversion of SparseFlashAttention's outputs, empty rows included. The
GE conversion itself is in ``tests/torchair_tier``."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from dcpgraph.backends.npu.rules_sparse import lse_from_max_sum, merge_topk_aten
from dcpgraph.ops.sparse_kernels import merge_topk, select_topk
from dcpgraph.testing.strategies import seeds

NEG_INF = float("-inf")


@given(seed=seeds(), shards=st.integers(1, 5), length=st.integers(0, 24), k=st.integers(1, 12),
       levels=st.integers(1, 4))
def test_aten_merge_selects_the_same_set_as_the_reference(seed, shards, length, k, levels):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (3, length), generator=gen).float()
    scores = scores.masked_fill(torch.rand(3, length, generator=gen) < 0.2, NEG_INF)
    owner = torch.randint(0, shards, (length,), generator=gen)
    values, positions = [], []
    for r in range(shards):
        mine = torch.nonzero(owner == r).flatten()
        vals, local = select_topk(scores[:, mine], k)
        values.append(vals)
        positions.append(torch.where(local >= 0, mine[local.clamp(min=0)] if mine.numel() else local, -1))
    values, positions = torch.stack(values), torch.stack(positions)
    want, got = merge_topk(values, positions, k), merge_topk_aten(values, positions, k)
    assert got.shape == want.shape
    for t in range(3):
        assert sorted(got[t].tolist()) == sorted(want[t].tolist())


def test_max_sum_to_lse_matches_logsumexp_and_maps_empty_rows_to_minus_inf():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 3, 7, generator=gen)  # [T, N, keys]
    peak = scores.max(-1).values
    total = torch.exp(scores - peak.unsqueeze(-1)).sum(-1)
    peak[2] = NEG_INF  # an empty row as the op may report it: max −inf, sum 0
    total[2] = 0.0
    peak[3, 1] = 0.0  # or max 0, sum 0
    total[3, 1] = 0.0
    lse = lse_from_max_sum(peak.unsqueeze(0), total.unsqueeze(0), 4)  # the op's [1, T, N]
    want = torch.logsumexp(scores, -1)
    torch.testing.assert_close(lse[:2], want[:2])
    assert bool((lse[2] == NEG_INF).all()) and lse[3, 1] == NEG_INF
    assert not torch.isnan(lse).any() and math.isclose(float(lse[3, 0]), float(want[3, 0]), rel_tol=1e-6)
