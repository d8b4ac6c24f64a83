"""DeepSeek-V4's compressed attention as canonical ops (``torch.ops.dcpgraph``), over one traced
sequence per batch row that starts at position 0 (a whole prompt, as ``dcpgraph.trace`` runs it).

==============================================  ==================================================
op                                              meaning
==============================================  ==================================================
``compress_windows(kv, gate, position_bias,     the compressor from an empty open window: ``kv``/
rate, overlap)``                                ``gate`` ``[B, T, width]`` → entries in **row
                                                form** ``[B, T, D]`` (before the layer's norm and
                                                rotary): row ``t`` holds entry ``w = (t + 1)/m − 1``
                                                where token ``t`` closes it (``(t + 1) % m == 0``),
                                                zeros elsewhere, :func:`~.compressor.compress_stream`
``compressed_topk(index_q, weights, index_keys, CSA's lightning indexer: ``index_q [B, T, Hi, Di]``,
positions, scale, rate, topk)``                 ``weights [B, T, Hi]``, ``index_keys [B, T, Di]``
                                                (row form) → the ``topk`` entries ``[B, T, topk]``
                                                (int64, −1 padded) of each query among those it
                                                may see (``w < (p + 1) // m``), score descending
                                                then index ascending
``compressed_attention(q, kv, entries,          HF layout ``q [B, H, T, D]``, the raw K=V
positions, sinks, scale, window, rate,          ``kv [B, 1, T, D]``, ``entries [B, T, D]`` (row
selected)``                                     form) → ``[B, H, T, D]``: one softmax over the raw
                                                tokens ``p − W < j <= p``, the visible entries
                                                (only the ``selected`` ones when given) and the
                                                per-head sink ``exp(s_h)``, which has no value
==============================================  ==================================================

Row form keeps every tensor of the layer token-major: the entry a token closes sits on that
token's row, so the front end norms and rotates it at position ``p + 1 − m = w·m`` row by row, and
a cached step (:mod:`.compressed_cached`) emits the entries its new tokens close on their rows
without knowing how many entries came before. The entries of a row-form tensor are its rows at
``(p + 1) % m == 0`` in order (:func:`entries_of_rows`).

The kernels are the exact references of :mod:`.compressor` and :mod:`.compressed_attention` at one
rank (``dcp = 1``), tested there against dense formulas and, end to end, against HF's V4.
"""

from __future__ import annotations

import torch

from .compressed_attention import ShardedCompressedCache
from .compressor import compress_stream, open_window, visible_entries
from .sparse_kernels import index_scores, select_topk

NS = "dcpgraph"
_lib = torch.library.Library(NS, "FRAGMENT")
_lib.define("compress_windows(Tensor kv, Tensor gate, Tensor position_bias, int rate, bool overlap) -> Tensor")
_lib.define("compressed_topk(Tensor index_q, Tensor weights, Tensor index_keys, Tensor positions, float scale, "
            "int rate, int topk) -> Tensor")
_lib.define("compressed_attention(Tensor q, Tensor kv, Tensor entries, Tensor positions, Tensor sinks, "
            "float scale, int window, int rate, Tensor? selected) -> Tensor")


def closing_rows(positions: torch.Tensor, rate: int) -> torch.Tensor:
    """Whether the token at each global position closes a window (``(p + 1) % m == 0``)."""
    return torch.remainder(positions + 1, rate) == 0


def entries_of_rows(rows: torch.Tensor, positions: torch.Tensor, rate: int) -> torch.Tensor:
    """Row-form entries ``rows [T, D]`` of one sequence from position 0 → entries ``[T // m, D]``."""
    return rows[closing_rows(positions, rate)]


def _compress_windows(kv, gate, position_bias, rate, overlap):
    rows = []
    width = kv.shape[-1] // 2 if overlap else kv.shape[-1]
    for b in range(kv.shape[0]):
        pooled, _ = compress_stream(open_window(kv.shape[-1], dtype=kv.dtype, device=kv.device), kv[b], gate[b],
                                    position_bias, rate=rate, overlap=overlap)
        row = kv.new_zeros(kv.shape[1], width)
        row[rate - 1::rate] = pooled
        rows.append(row)
    return torch.stack(rows)


def _compress_windows_fake(kv, gate, position_bias, rate, overlap):
    width = kv.shape[-1] // 2 if overlap else kv.shape[-1]
    return kv.new_empty((kv.shape[0], kv.shape[1], width))


def _compressed_topk(index_q, weights, index_keys, positions, scale, rate, topk):
    rows = []
    for b in range(index_q.shape[0]):
        keys = entries_of_rows(index_keys[b], positions[b], rate)
        scores = index_scores(index_q[b], keys, weights[b], scale)  # [T, E]
        entries = torch.arange(keys.shape[0], device=scores.device)
        visible = entries.unsqueeze(0) < visible_entries(positions[b], rate).unsqueeze(1)
        rows.append(select_topk(scores.masked_fill(~visible, float("-inf")), topk)[1])
    return torch.stack(rows)


def _compressed_topk_fake(index_q, weights, index_keys, positions, scale, rate, topk):
    return index_q.new_empty((index_q.shape[0], index_q.shape[1], topk), dtype=torch.int64)


def _compressed_attention(q, kv, entries, positions, sinks, scale, window, rate, selected):
    rows = []
    for b in range(q.shape[0]):
        cache = ShardedCompressedCache(dcp=1, window=window, rate=rate, head_dim=q.shape[-1], dtype=q.dtype)
        cache.append_tokens(positions[b], kv[b, 0])
        cache.append_entries(0, entries_of_rows(entries[b], positions[b], rate))
        chosen = None if selected is None else selected[b]
        out = cache.attend(q[b].transpose(0, 1), positions[b], sinks, scale=scale, selected=chosen)  # [T, H, D]
        rows.append(out.transpose(0, 1))
    return torch.stack(rows)


def _compressed_attention_fake(q, kv, entries, positions, sinks, scale, window, rate, selected):
    return torch.empty_like(q)


for _name, _kernel, _fake in (("compress_windows", _compress_windows, _compress_windows_fake),
                              ("compressed_topk", _compressed_topk, _compressed_topk_fake),
                              ("compressed_attention", _compressed_attention, _compressed_attention_fake)):
    _lib.impl(_name, _kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NS}::{_name}", _fake, lib=_lib)
