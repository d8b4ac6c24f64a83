"""DSA ops → Ascend: LightningIndexer, SparseFlashAttention, and an aten global top-k merge.

Both Ascend ops take TND queries with ``actual_seq_lengths_query`` (cumulative query ends) and a
paged key ``[NB, B, 1, D]`` (``layout_kv="PA_BSND"``) with a block table and per-row key counts.
Under DCP a query's visible local keys are a per-*query* bound (``layout.local_len(p + 1, r)``),
which no causal mode of the ops expresses on a shard, so every token is lowered as its own row:
``actual_seq_lengths_query = 1, 2, …, T``, the block table row of its request repeated per token,
``sparse_mode=0`` (no mask; the key count alone bounds the keys).

``paged_indexer_topk`` → ``npu_lightning_indexer`` (``return_value=True``). The op computes
``Σ_h w_h·relu(q_h·k)`` with no scale: dcpgraph's scale is folded into the weights, exact because
``relu(s·x) = s·relu(x)`` for ``s > 0`` (the checker requires it). Its outputs are
``[T, 1, topk]``; entries past the valid keys are −1 and get score −inf here.

``paged_sparse_attention`` (MLA latent cache ``[c ‖ k_rope]``, values ``c``) →
``npu_sparse_flash_attention`` with ``query``/``key``/``value`` the latent ``R`` dims and
``query_rope``/``key_rope`` the rest, ``attention_mode=2`` (absorbed MLA), ``sparse_indices``
``[T, 1, K]`` int32 (−1 skipped), ``return_softmax_lse=True``. The op returns the softmax max and
sum ``[1, T, N]`` instead of a log-sum-exp: converted once to ``lse = max + log(sum)`` in fp32,
``[T, N]``; a token with no selected key (an empty shard) gets ``(0, −inf)`` whatever the op
returns there (undocumented), and a zero sum maps to −inf, never NaN.

``merge_topk`` → aten, without a stable sort (GE has no converter for ``sort.stable``): with ``v*``
the k-th best candidate score (``topk`` values, ties irrelevant), the selection is every candidate
above ``v*`` plus the lowest positions among those equal to ``v*``; one ``topk`` over the key
``BIG`` (above) / ``−position`` (tied) / ``−inf`` (rest) picks exactly that set (positions are
distinct, so that key has no ties). Exact for positions below 2²⁴ (the key is fp32).

Unverified without Ascend hardware: both kernels' numerics; how LightningIndexer orders equal
scores (the cross-rank merge is exact when each rank's list is its top-k under *some* order that
agrees with position order on ties; another tie order may select a different key of the same
score); the shapes of ``softmax_max``/``softmax_sum`` (taken from vLLM Ascend's use of the op);
the kernels' limits (latent 512 + rope 64, block size 128, fp16/bf16).
"""

from __future__ import annotations

import torch

from ...ops.merge import NEG_INF
from .ascend import lightning_indexer_op, sparse_flash_attention_op
from .rules import Site, register
from .rules_attention import latent_prefix

dcp_ops = torch.ops.dcpgraph
KEY_BIG = 3.0e38  # above every fp32 −position key
ASCEND_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _token_rows(q: torch.Tensor, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor):
    """Per-token rows: ``(cumulative query ends 1..T, block table row of each token's request)``."""
    ones = torch.ones_like(q.select(-1, 0).select(-1, 0), dtype=torch.int64)  # [T]
    ends = ones.cumsum(0)
    positions = ends - ones
    row = (positions.unsqueeze(1) >= cu_seqlens_q[1:].to(torch.int64).unsqueeze(0)).to(torch.int64).sum(1)
    return ends, block_table.index_select(0, row).to(torch.int32)


def _dtype_reason(q: torch.Tensor) -> str | None:
    if q.dtype not in ASCEND_DTYPES:
        return f"the Ascend sparse ops have no {q.dtype} form (build the program in bf16/fp16)"
    return None


def _indexer_applies(site: Site) -> str | None:
    scale = site.args[6]
    if not scale > 0:
        return f"the indexer scale ({scale}) must be positive to fold into the weights"
    if site.args[2].shape[2] != 1:
        return "the index-key cache must have one head"
    return _dtype_reason(site.args[0])


def paged_indexer_topk_lightning(q, weights, index_cache, block_table, cu_seqlens_q, kv_bound, scale, topk):
    ends, rows = _token_rows(q, block_table, cu_seqlens_q)
    indices, values = lightning_indexer_op()(
        q, index_cache, (weights * scale).to(q.dtype),
        actual_seq_lengths_query=ends.to(torch.int32), actual_seq_lengths_key=kv_bound.to(torch.int32),
        block_table=rows, layout_query="TND", layout_key="PA_BSND", sparse_count=topk, sparse_mode=0,
        return_value=True,
    )
    indices = indices.reshape(indices.shape[0], topk).to(torch.int64)
    values = values.reshape(indices.shape[0], topk).to(torch.float32)
    return torch.where(indices >= 0, values, NEG_INF), indices


def _sparse_applies(site: Site) -> str | None:
    if not latent_prefix(site.node.args[1], site.node.args[2]):
        return "SparseFlashAttention is lowered for MLA latent caches only (values a prefix of the keys)"
    return _dtype_reason(site.args[0])


def _sparse_params(site: Site) -> dict:
    return {"latent": latent_prefix(site.node.args[1], site.node.args[2]), "out_dtype": site.output(0).dtype,
            "lse_dtype": site.output(1).dtype}


def lse_from_max_sum(softmax_max: torch.Tensor, softmax_sum: torch.Tensor, tokens: int) -> torch.Tensor:
    """``max + log(sum)`` as ``[T, N]`` fp32 from the op's ``[1, T, N]`` max and sum; −inf where the
    sum is not positive (no key), so an empty row never yields NaN."""
    total = softmax_sum.to(torch.float32)
    lse = softmax_max.to(torch.float32) + torch.log(torch.where(total > 0, total, 1.0))
    lse = torch.where(total > 0, lse, NEG_INF)
    return lse.permute(1, 0, 2).reshape(tokens, -1)


def paged_sparse_attention_sfa(q, k_cache, v_cache, block_table, cu_seqlens_q, indices, scale, *,
                               latent, out_dtype, lse_dtype):
    ends, rows = _token_rows(q, block_table, cu_seqlens_q)
    idx = indices.to(torch.int64)
    key_counts = (idx.max(dim=-1).values + 1).clamp(min=0)  # keys a token's indices can reach
    out, softmax_max, softmax_sum = sparse_flash_attention_op()(
        q[..., :latent], k_cache[..., :latent], k_cache[..., :latent], idx.to(torch.int32).unsqueeze(1),
        float(scale), block_table=rows, actual_seq_lengths_query=ends.to(torch.int32),
        actual_seq_lengths_kv=key_counts.to(torch.int32), query_rope=q[..., latent:],
        key_rope=k_cache[..., latent:], sparse_block_size=1, layout_query="TND", layout_kv="PA_BSND",
        sparse_mode=0, attention_mode=2, return_softmax_lse=True,
    )
    lse = lse_from_max_sum(softmax_max, softmax_sum, q.shape[0])
    has_keys = (idx >= 0).any(dim=-1)
    out = torch.where(has_keys.view(-1, 1, 1), out.to(out_dtype), 0.0)
    return out, torch.where(has_keys.view(-1, 1), lse, NEG_INF).to(lse_dtype)


def merge_topk_aten(values, positions, topk):
    """``merge_topk`` with two ``topk``s (see the module docstring)."""
    n, t, kk = positions.shape
    vals = values.permute(1, 0, 2).reshape(t, n * kk).to(torch.float32)
    pos = positions.permute(1, 0, 2).reshape(t, n * kk)
    valid = (pos >= 0) & (vals > NEG_INF)
    vals = torch.where(valid, vals, NEG_INF)
    m = min(topk, n * kk)
    threshold = vals.topk(m, dim=-1).values[:, m - 1:m]  # the m-th best score (−inf: fewer valid)
    above = valid & (vals > threshold)
    tied = valid & (vals == threshold)
    key = torch.where(above, KEY_BIG, torch.where(tied, -pos.to(torch.float32), NEG_INF))
    best, order = key.topk(m, dim=-1)
    chosen = torch.where(best > NEG_INF, pos.gather(-1, order), -1)
    if m < topk:
        chosen = torch.cat([chosen, chosen.new_full((t, topk - m), -1)], dim=-1)
    return chosen


register(dcp_ops.paged_indexer_topk.default, "paged_indexer_topk->LightningIndexer", checker=_indexer_applies,
         uses="npu")(paged_indexer_topk_lightning)
register(dcp_ops.paged_sparse_attention.default, "paged_sparse_attention(mla)->SparseFlashAttention",
         checker=_sparse_applies, params=_sparse_params, uses="npu")(paged_sparse_attention_sfa)
register(dcp_ops.merge_topk.default, "merge_topk->aten(topk)")(merge_topk_aten)
