"""Reference kernels of DeepSeek sparse attention (DSA): the lightning indexer, top-k selection and
attention over selected tokens. Plain torch, CPU, inference only.

Indexer score of query ``t`` for key ``j`` (DeepSeek-V3.2's lightning indexer, fp32 as HF)::

    score[t, j] = Σ_h w[t, h] · relu(scale · q[t, h]·k[j])

**Tie rule** (one rule everywhere: dense, per shard, and in the cross-shard merge): keys are ranked
by score descending, then by position ascending; a key with score −inf (not visible to the query)
is never selected; fewer than ``k`` selectable keys leave the tail as position −1 (score −inf).
torch's own ``topk`` leaves the order of equal scores unspecified (on CPU it depends on the
partial sort), so no implementation can reproduce it; this rule is the deterministic one.

Merge exactness: under any partition of a query's keys into shards, the global top-``k`` set is a
subset of the union of the shards' top-``k`` lists (a key beaten by ``k`` keys of its own shard is
beaten by them globally), and ranking the union by the same total order picks exactly it
(:func:`merge_topk`).
"""

from __future__ import annotations

import torch

from .kernels import acc_dtype, softmax_attend
from .paged import gather_paged

NEG_INF = float("-inf")
INDEX_DTYPE = torch.float32  # the indexer scores in fp32 whatever the model dtype (as HF does)


def index_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [T, Hi, D]``, ``k [L, D]``, ``weights [T, Hi]`` → fp32 scores ``[T, L]``."""
    per_head = torch.matmul(q.to(INDEX_DTYPE), k.to(INDEX_DTYPE).transpose(0, 1)) * scale  # [T, Hi, L]
    per_head = torch.relu(per_head)
    return torch.matmul(weights.to(INDEX_DTYPE).unsqueeze(-2), per_head).squeeze(-2)


def select_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best keys of each row of ``scores [T, L]`` (−inf: not selectable) by the tie rule
    → ``(values [T, k], indices [T, k] int64)``, padded with ``(−inf, −1)``."""
    t, length = scores.shape
    values = torch.full((t, k), NEG_INF, dtype=scores.dtype, device=scores.device)
    indices = torch.full((t, k), -1, dtype=torch.int64, device=scores.device)
    if length == 0 or k == 0:
        return values, indices
    # A stable descending sort keeps equal scores in ascending position order.
    sorted_values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    n = min(k, length)
    top_values, top_order = sorted_values[:, :n], order[:, :n]
    valid = top_values > NEG_INF
    values[:, :n] = torch.where(valid, top_values, NEG_INF)
    indices[:, :n] = torch.where(valid, top_order, -1)
    return values, indices


def merge_topk(values: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """Global top-``k`` positions ``[T, k]`` from per-shard candidates ``values [N, T, K]`` and
    their global ``positions [N, T, K]`` (−1: no candidate), by the tie rule; −1 padded.

    Exact when each shard's list is its own top-``K`` with ``K >= k`` (or all its keys)."""
    n, t, kk = positions.shape
    vals = values.permute(1, 0, 2).reshape(t, n * kk)
    pos = positions.permute(1, 0, 2).reshape(t, n * kk).to(torch.int64)
    valid = (pos >= 0) & (vals > NEG_INF)
    vals = torch.where(valid, vals, NEG_INF)
    # Position ascending first (invalid last), then a stable sort by value descending.
    big = torch.iinfo(torch.int64).max
    by_pos, order = torch.sort(torch.where(valid, pos, big), dim=-1, stable=True)
    vals = torch.gather(vals, -1, order)
    sorted_vals, order2 = torch.sort(vals, dim=-1, descending=True, stable=True)
    sorted_pos = torch.gather(by_pos, -1, order2)
    out = torch.full((t, k), -1, dtype=torch.int64, device=positions.device)
    m = min(k, n * kk)
    chosen = sorted_pos[:, :m]
    out[:, :m] = torch.where(sorted_vals[:, :m] > NEG_INF, chosen, -1)
    return out


def indexer_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float, topk: int) -> torch.Tensor:
    """Canonical (HF layout, causal top-left): ``q [B, S, Hi, D]``, ``k [B, S, D]``,
    ``weights [B, S, Hi]`` → selected positions ``[B, S, topk]`` (int64, −1 padded)."""
    out = []
    for b in range(q.shape[0]):
        s = q.shape[1]
        scores = index_scores(q[b], k[b], weights[b], scale)
        causal = torch.ones(s, k.shape[1], dtype=torch.bool, device=q.device).tril()
        out.append(select_topk(scores.masked_fill(~causal, NEG_INF), topk)[1])
    return torch.stack(out)


def _visible_from_indices(indices: torch.Tensor, keys: int, limit: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, keys]`` bool: key ``j`` selected for query ``t`` (entries −1 ignored), and ``j < limit[t]``."""
    visible = torch.zeros(indices.shape[0], keys + 1, dtype=torch.bool, device=indices.device)
    idx = torch.where(indices >= 0, indices, keys).clamp(max=keys)
    visible.scatter_(1, idx, True)
    visible = visible[:, :keys]
    if limit is not None:
        visible &= torch.arange(keys, device=indices.device).unsqueeze(0) < limit.unsqueeze(1)
    return visible


def attend_selected(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, Hq, D]`` over ``k [L, Hkv, D]``, ``v [L, Hkv, Dv]`` with ``visible [T, L]`` →
    ``(out [T, Hq, Dv], lse [T, Hq])``; a query with no visible key gives ``(0, −inf)``."""
    t, hq, _ = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    acc = acc_dtype(q.dtype)
    qf = q.to(acc).reshape(t, hkv, group, -1).permute(1, 2, 0, 3)  # [Hkv, G, T, D]
    kf = k.to(acc).permute(1, 2, 0).unsqueeze(1)  # [Hkv, 1, D, L]
    vf = v.to(acc).permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, L, Dv]
    out, lse = softmax_attend(torch.matmul(qf, kf) * scale, vf, visible)
    return out.permute(2, 0, 1, 3).reshape(t, hq, -1).to(q.dtype), lse.permute(2, 0, 1).reshape(t, hq)


def sparse_attention(q, k, v, indices, scale):
    """Canonical (HF layout): ``q [B, H, S, D]``, ``k/v [B, Hkv, S, ·]``, ``indices [B, S, K]`` →
    ``[B, H, S, Dv]``: query ``s`` attends over the selected keys ``j <= s``."""
    outs = []
    for b in range(q.shape[0]):
        s = q.shape[2]
        visible = _visible_from_indices(indices[b].to(torch.int64), k.shape[2],
                                        torch.arange(1, s + 1, device=q.device))
        o, _ = attend_selected(q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1), visible, scale)
        outs.append(o.transpose(0, 1))
    return torch.stack(outs).contiguous()


def _rows(cu_seqlens_q: torch.Tensor):
    cu = cu_seqlens_q.to(torch.int64).tolist()
    return [(r, cu[r], cu[r + 1]) for r in range(len(cu) - 1) if cu[r + 1] > cu[r]]


def _row_keys(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    block = cache.shape[1]
    return gather_paged(cache, table_row[: -(-length // block)].tolist(), length)


def paged_indexer_topk(q, weights, index_cache, block_table, cu_seqlens_q, kv_bound, scale, topk):
    """Each query ``t`` of row ``r`` scores the local keys ``j < kv_bound[t]`` of its row (key ``j``
    at slot ``block_table[r, j // B]·B + j % B`` of ``index_cache [NB, B, 1, D]``) and keeps its
    top-``topk`` → ``(values [T, topk] fp32, local indices [T, topk] int64)``, (−inf, −1) padded."""
    t = q.shape[0]
    values = torch.full((t, topk), NEG_INF, dtype=INDEX_DTYPE, device=q.device)
    indices = torch.full((t, topk), -1, dtype=torch.int64, device=q.device)
    bound = kv_bound.to(torch.int64)
    for r, start, end in _rows(cu_seqlens_q):
        length = int(bound[start:end].max())
        if length <= 0:
            continue
        keys = _row_keys(index_cache, block_table[r], length)[:, 0]  # [L, D]
        scores = index_scores(q[start:end], keys, weights[start:end], scale)
        hidden = torch.arange(length, device=q.device).unsqueeze(0) >= bound[start:end].unsqueeze(1)
        values[start:end], indices[start:end] = select_topk(scores.masked_fill(hidden, NEG_INF), topk)
    return values, indices


def paged_sparse_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, indices, scale):
    """Query ``t`` of row ``r`` attends over the local keys listed in ``indices[t]`` (−1: none) of
    its row's paged cache → ``(out [T, Hq, Dv], lse [T, Hq])``; no key gives ``(0, −inf)``."""
    t, hq, _ = q.shape
    dv = v_cache.shape[-1]
    out = torch.zeros(t, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.full((t, hq), NEG_INF, dtype=acc_dtype(q.dtype), device=q.device)
    idx = indices.to(torch.int64)
    for r, start, end in _rows(cu_seqlens_q):
        length = int(idx[start:end].max()) + 1 if idx[start:end].numel() else 0
        if length <= 0:
            continue
        keys = _row_keys(k_cache, block_table[r], length)
        values = _row_keys(v_cache, block_table[r], length)
        visible = _visible_from_indices(idx[start:end], length)
        out[start:end], lse[start:end] = attend_selected(q[start:end], keys, values, visible, scale)
    return out, lse
