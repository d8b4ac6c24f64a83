"""dcpgraph's sparse-attention (DSA) ops, in the ``torch.ops.dcpgraph`` namespace; reference kernels
in :mod:`dcpgraph.ops.sparse_kernels` (tie rule and merge exactness are stated there).

=========================================  ======================================================
op                                         meaning
=========================================  ======================================================
``causal_mask(batch, q_len, kv_len)``      bool ``[B, 1, S, T]``, top-left causal: the mask the
                                           front end hands to a model that insists on one (the
                                           DSA indexer); recognised and removed by canonicalize
``indexer_topk(q,k,weights,scale,topk)``   canonical indexer: HF layout, causal, positions
                                           ``[B, S, topk]`` (int64, −1 padded)
``sparse_attention(q,k,v,indices,scale)``  canonical attention of query ``s`` over its selected
                                           keys ``j <= s`` (HF layout)
``paged_indexer_topk(q,weights,cache,      local top-k of each query over its paged index-key
table,cu_q,kv_bound,scale,topk)``          cache, keys ``j < kv_bound[t]`` → (values, indices)
``merge_topk(values,positions,topk)``      global top-k of per-shard candidates ``[N, T, K]``
``paged_sparse_attention(q,kc,vc,table,    attention over the selected local keys of a paged
cu_q,indices,scale)``                      cache → ``(out, lse)`` (no key: ``(0, −inf)``)
=========================================  ======================================================
"""

from __future__ import annotations

import torch

from . import sparse_kernels as sk
from .kernels import acc_dtype

NS = "dcpgraph"
_lib = torch.library.Library(NS, "FRAGMENT")
_SCHEMAS = {
    "causal_mask": "causal_mask(int batch, SymInt q_len, SymInt kv_len, Device? device=None) -> Tensor",
    "indexer_topk": "indexer_topk(Tensor q, Tensor k, Tensor weights, float scale, int topk) -> Tensor",
    "sparse_attention": "sparse_attention(Tensor q, Tensor k, Tensor v, Tensor indices, float scale) -> Tensor",
    "paged_indexer_topk": (
        "paged_indexer_topk(Tensor q, Tensor weights, Tensor index_cache, Tensor block_table, "
        "Tensor cu_seqlens_q, Tensor kv_bound, float scale, int topk) -> (Tensor, Tensor)"
    ),
    "merge_topk": "merge_topk(Tensor values, Tensor positions, int topk) -> Tensor",
    "paged_sparse_attention": (
        "paged_sparse_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor cu_seqlens_q, Tensor indices, float scale) -> (Tensor, Tensor)"
    ),
}
for _schema in _SCHEMAS.values():
    _lib.define(_schema)


def _register(name: str, kernel, fake) -> None:
    _lib.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NS}::{name}", fake, lib=_lib)


def _causal_mask(batch, q_len, kv_len, device=None):
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril()
    return mask.expand(batch, 1, q_len, kv_len).contiguous()


def _causal_mask_fake(batch, q_len, kv_len, device=None):
    return torch.empty((batch, 1, q_len, kv_len), dtype=torch.bool, device=device)


def _indexer_topk_fake(q, k, weights, scale, topk):
    return q.new_empty((*q.shape[:2], topk), dtype=torch.int64)


def _sparse_attention(q, k, v, indices, scale):
    return sk.sparse_attention(q, k, v, indices, scale)


def _sparse_attention_fake(q, k, v, indices, scale):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _paged_indexer_topk_fake(q, weights, index_cache, block_table, cu_seqlens_q, kv_bound, scale, topk):
    return (q.new_empty((q.shape[0], topk), dtype=sk.INDEX_DTYPE),
            q.new_empty((q.shape[0], topk), dtype=torch.int64))


def _merge_topk_fake(values, positions, topk):
    return positions.new_empty((positions.shape[1], topk), dtype=torch.int64)


def _paged_sparse_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, indices, scale):
    out, lse = sk.paged_sparse_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, indices, scale)
    return out.contiguous(), lse.contiguous()


def _paged_sparse_attention_fake(q, k_cache, v_cache, block_table, cu_seqlens_q, indices, scale):
    return (q.new_empty((*q.shape[:-1], v_cache.shape[-1])),
            q.new_empty(q.shape[:-1], dtype=acc_dtype(q.dtype)))


_register("causal_mask", _causal_mask, _causal_mask_fake)
_register("indexer_topk", sk.indexer_topk, _indexer_topk_fake)
_register("sparse_attention", _sparse_attention, _sparse_attention_fake)
_register("paged_indexer_topk", sk.paged_indexer_topk, _paged_indexer_topk_fake)
_register("merge_topk", sk.merge_topk, _merge_topk_fake)
_register("paged_sparse_attention", _paged_sparse_attention, _paged_sparse_attention_fake)

ops = torch.ops.dcpgraph
causal_mask = ops.causal_mask
indexer_topk = ops.indexer_topk
sparse_attention = ops.sparse_attention
paged_indexer_topk = ops.paged_indexer_topk
merge_topk = ops.merge_topk
paged_sparse_attention = ops.paged_sparse_attention
