"""Capacity and decode reads of DeepSeek-V4's compressed caches on one rank, from the byte formula
of :mod:`.compressed_cache` (the only place it lives).

V4's caches are not paged per token: a request of ``L`` tokens holds, per rank, ``total(L) =``
raw window + compressed entries + CSA indexer keys + open windows
(:class:`~.compressed_cache.CompressedCacheBytes`), so for a per-rank budget ``B``::

    max_requests(L)   = B // total(L)                      requests of L tokens at once
    longest_request   = max { L : total(L) <= B }          one request alone

``total`` is non-decreasing in ``L`` (entries only accumulate), so the longest request is found by
bisection over the formula itself.

A decode step of one query token reads, per rank and layer, the raw window's rows
``share(W)`` (the query's own token included), on an HCA layer every entry it holds
``share(L // m)``, on a CSA layer every indexer key it holds and the selected entries it owns,
``⌈min(index_topk, L // m) / N⌉`` (the top-k spread over the ranks), each row of ``D``
attended by the DCP group's query heads (``2·(D + D)`` FLOPs per head: scores and values), each
indexer key scored by every indexer head (``2·Di``).
"""

from __future__ import annotations

import math

from ..layout import max_local_len
from .compressed_cache import CompressedCacheBytes, compressed_cache_bytes
from .compressed_model import CSA, HCA


def request_bytes(shape, context: int, dcp: int, interleave: int, kv_cache_dtype: str = "auto") -> CompressedCacheBytes:
    """One rank's bytes for one request of ``context`` tokens: rows (and indexer keys) in the
    cache's dtype, with their scales at fp8; the open windows in the model's dtype."""
    return compressed_cache_bytes(shape.compressed_config(), context_tokens=context, dcp=dcp,
                                  interleave=interleave, element_bytes=shape.kv_element_bytes(kv_cache_dtype),
                                  fp8_scales=kv_cache_dtype == "fp8_e4m3", state_element_bytes=shape.dtype_bytes)


def max_requests(shape, budget: int, context: int, dcp: int, interleave: int, kv_cache_dtype: str = "auto") -> int:
    """Requests of ``context`` tokens that fit in ``budget`` bytes per rank at once."""
    return budget // request_bytes(shape, context, dcp, interleave, kv_cache_dtype).total


def longest_request(shape, budget: int, dcp: int, interleave: int, kv_cache_dtype: str, limit: int) -> int:
    """The longest request (tokens, at most ``limit``) whose bytes fit in ``budget`` per rank;
    ``-1`` when not even an empty one does (its window and open windows)."""
    def fits(n: int) -> bool:
        return request_bytes(shape, n, dcp, interleave, kv_cache_dtype).total <= budget

    if not fits(0):
        return -1
    lo, hi = 0, limit
    if fits(hi):
        return hi
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def attention_read(shape, tp: int, dcp: int, interleave: int, context: int, batch: int,
                   element_bytes: int) -> tuple[float, float]:
    """``(bytes, flops)`` of one decode step's attention on one rank, averaged over the layers
    (module docstring); :func:`~.cost.decode_step` multiplies by the layer count."""
    d, di = shape.head_dim, shape.index_head_dim
    heads = shape.q_heads_per_rank(tp) * dcp
    rates = dict(shape.compress_rates)
    rows = keys = 0
    for kind in shape.layer_types:
        rows += max_local_len(shape.sliding_window, dcp, interleave)
        if kind == HCA:
            rows += max_local_len(context // rates[kind], dcp, interleave)
        elif kind == CSA:
            entries = context // rates[kind]
            keys += max_local_len(entries, dcp, interleave)
            rows += math.ceil(min(shape.index_topk, entries) / dcp)
    layers = len(shape.layer_types)
    read = batch * (rows * d + keys * di) * element_bytes / layers
    flops = batch * (rows * 2 * heads * 2 * d + keys * 2 * shape.index_heads * di) / layers
    return read, flops
