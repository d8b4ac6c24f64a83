"""DeepSeek-V4's compressed attention over paged caches and per-request open windows (cached forms).

``insert_compressed_cache`` turns the canonical ops of :mod:`.compressed` into these, over a
step's flattened tokens (``[1, T, ·]``, requests split by ``cu_seqlens_q``, request ``r`` having
``context_lens[r]`` tokens cached before the step). Entries stay in row form (the entry a token
closes on its row). At one rank (``dcp = 1``):

==============================================  ==================================================
op                                              meaning
==============================================  ==================================================
``compress_windows_(kv, gate, position_bias,    the compressor carried across steps: the request's
open_windows, state_slots, cu_seqlens_q,        last ``2m`` source rows ``[kv ‖ gate]`` live in its
context_lens, rate, overlap)``                  slot of ``open_windows [S, 2m, 2·width]``
                                                (right-aligned; a row with no context starts
                                                empty) and give its :class:`~.compressor.
                                                OpenWindow`: the last ``c mod m`` rows and, for
                                                CSA, the carry of the window before them
``compressed_topk_(index_q, weights,            writes this step's indexer keys (the rows that
index_keys, positions, index_cache,             close a window) at their **entry index** ``w`` of
block_table, cu_seqlens_q, context_lens,        the request's paged cache, then selects among its
scale, rate, topk, block_size)``                entries ``w < (p + 1) // m`` (tie rule of
                                                :mod:`.sparse_kernels`)
``compressed_attention_(q, kv, entries,         writes the raw K=V rows at their token positions
positions, sinks, kv_cache, entry_cache,        (through ``window_table``) and the entries at their
block_table, window_table, cu_seqlens_q,        entry index (through ``block_table``), then one
context_lens, scale, window, rate, selected,    softmax per query over the raw tokens ``p − W < j
block_size)``                                   <= p``, the visible (selected) entries and the sink
==============================================  ==================================================

Token position ``i`` lives at slot ``block_table[r, i // B]·B + i mod B``. The entry caches hold
``ceil(B / m)`` rows per block (``CacheSpec.tokens_per_row = m``): entry ``w`` sits in the block
of its first token ``w·m`` at row ``(w·m mod B) // m``, so the request's blocks always hold its
entries and an entry cache costs ``D·b/m`` bytes per token where ``m`` divides ``B``. The raw rows are addressed through ``window_table``: the same
table, or with ``hybrid_kv_cache`` the sliding group's, whose blocks wholly before the step's
first ``p − W + 1`` may be the null block (:mod:`dcpgraph.runtime.layer_groups`); they are never
read. The open window does not grow with context: it is per-request
state, taken at admission and freed at finish; a preempted request restarts from no context.
"""

from __future__ import annotations

import torch

from .compressed import closing_rows
from .compressed_attention import with_sinks
from .compressor import OpenWindow, compress_stream, visible_entries
from .fp8_rows import is_packed, pack_rows, unpack_rows
from .sparse_kernels import attend_selected, index_scores, select_topk

NS = "dcpgraph"
_lib = torch.library.Library(NS, "FRAGMENT")
_lib.define("compress_windows_(Tensor kv, Tensor gate, Tensor position_bias, Tensor(a!) open_windows, "
            "Tensor state_slots, Tensor cu_seqlens_q, Tensor context_lens, int rate, bool overlap) -> Tensor")
_lib.define("compressed_topk_(Tensor index_q, Tensor weights, Tensor index_keys, Tensor positions, "
            "Tensor(a!) index_cache, Tensor block_table, Tensor cu_seqlens_q, Tensor context_lens, float scale, "
            "int rate, int topk, int block_size) -> Tensor")
_lib.define("compressed_attention_(Tensor q, Tensor kv, Tensor entries, Tensor positions, Tensor sinks, "
            "Tensor(a!) kv_cache, Tensor(b!) entry_cache, Tensor block_table, Tensor window_table, "
            "Tensor cu_seqlens_q, Tensor context_lens, float scale, int window, int rate, Tensor? selected, "
            "int block_size) -> Tensor")


def _requests(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor):
    """``(row, start, end, context)`` of every request with new tokens this step."""
    cu, ctx = cu_seqlens_q.tolist(), context_lens.tolist()
    return [(r, cu[r], cu[r + 1], int(ctx[r])) for r in range(len(cu) - 1) if cu[r + 1] > cu[r]]


def paged_slots(table_row: torch.Tensor, indices: torch.Tensor, block: int) -> torch.Tensor:
    """Slots (flat ``[blocks·B]`` rows) of paged ``indices`` for one request's block-table row."""
    return table_row[torch.div(indices, block, rounding_mode="floor")].to(torch.int64) * block + indices % block


def entry_slots(table_row: torch.Tensor, entries: torch.Tensor, rate: int, block_size: int) -> torch.Tensor:
    """Slots of entries ``w`` in an entry cache of ``ceil(B / m)`` rows per block: entry ``w`` sits in
    the block of its first token ``w·m``, at row ``(w·m mod B) // m``."""
    first = entries * rate
    rows = -(-block_size // rate)
    block = table_row[torch.div(first, block_size, rounding_mode="floor")].to(torch.int64)
    return block * rows + torch.div(first % block_size, rate, rounding_mode="floor")


def _write(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Rows ``[n, ·]`` into ``slots`` of a cache ``[blocks, B, H, D]``: cast to its dtype, or, for an
    fp8 cache (uint8, :mod:`.fp8_rows`), quantised and packed with their scales."""
    flat = cache.view(-1, *cache.shape[2:])
    if is_packed(cache):
        flat[slots] = pack_rows(rows.reshape(rows.shape[0], cache.shape[2], -1))
        return
    flat[slots] = rows.reshape(rows.shape[0], *cache.shape[2:]).to(cache.dtype)


def _read(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows at ``slots`` (``[n, H, D]``; an fp8 cache's dequantised to fp32)."""
    rows = cache.view(-1, *cache.shape[2:])[slots]
    return unpack_rows(rows) if is_packed(cache) else rows


def _open_window(held: torch.Tensor, context: int, width: int, bias: torch.Tensor, rate: int,
                 overlap: bool) -> OpenWindow:
    """A request's :class:`OpenWindow` after ``context`` tokens from its last ``2m`` rows ``held``."""
    kv, gate = held[:, :width], held[:, width:]
    pending = context % rate
    rows = held.shape[0]
    open_kv, open_gate = kv[rows - pending:], gate[rows - pending:]
    if not overlap or context < rate:
        return OpenWindow(open_kv, open_gate, None, None, context // rate)
    half = width // 2
    last = slice(rows - pending - rate, rows - pending)
    return OpenWindow(open_kv, open_gate, kv[last, :half].clone(), gate[last, :half] + bias[:, :half],
                      context // rate)


def compress_windows_(kv, gate, position_bias, open_windows, state_slots, cu_seqlens_q, context_lens, rate, overlap):
    width = kv.shape[-1]
    keep = open_windows.shape[1]
    out = kv.new_zeros(*kv.shape[:2], width // 2 if overlap else width)
    slots = state_slots.tolist()
    for r, start, end, context in _requests(cu_seqlens_q, context_lens):
        slot = int(slots[r])
        held = (open_windows[slot] if context and slot >= 0
                else open_windows.new_zeros(keep, 2 * width)).to(kv.dtype)
        state = _open_window(held, context, width, position_bias, rate, overlap)
        new = torch.cat([kv[0, start:end], gate[0, start:end]], dim=-1)
        pooled, _ = compress_stream(state, kv[0, start:end], gate[0, start:end], position_bias, rate=rate,
                                    overlap=overlap)
        if pooled.shape[0]:
            closes = torch.arange(state.entries + 1, state.entries + 1 + pooled.shape[0], device=kv.device) * rate - 1
            out[0, start + closes - context] = pooled
        if slot >= 0:
            rows = torch.cat([held, new])[-keep:]
            open_windows[slot].copy_(rows.to(open_windows.dtype))
    return out


def _visible(pos: torch.Tensor, count: int, rate: int) -> torch.Tensor:
    """``[n, count]``: whether the query at each position may read entry ``w`` (``w < (p + 1) // m``)."""
    return torch.arange(count, device=pos.device).unsqueeze(0) < visible_entries(pos, rate).unsqueeze(1)


def _write_entries(cache, table_row, rows, positions, rate, block_size) -> None:
    closes = closing_rows(positions, rate)
    if bool(closes.any()):
        entries = torch.div(positions[closes] + 1, rate, rounding_mode="floor") - 1
        _write(cache, entry_slots(table_row, entries, rate, block_size), rows[closes])


def compressed_topk_(index_q, weights, index_keys, positions, index_cache, block_table, cu_seqlens_q, context_lens,
                     scale, rate, topk, block_size):
    out = torch.full((*index_q.shape[:2], topk), -1, dtype=torch.int64, device=index_q.device)
    for r, start, end, context in _requests(cu_seqlens_q, context_lens):
        pos = positions[0, start:end].to(torch.int64)
        _write_entries(index_cache, block_table[r], index_keys[0, start:end], pos, rate, block_size)
        count = (context + end - start) // rate
        keys = _read(index_cache, entry_slots(block_table[r], torch.arange(count, device=pos.device), rate,
                                              block_size))[:, 0]
        scores = index_scores(index_q[0, start:end], keys, weights[0, start:end], scale)  # [n, E]
        out[0, start:end] = select_topk(scores.masked_fill(~_visible(pos, count, rate), float("-inf")), topk)[1]
    return out


def compressed_attention_(q, kv, entries, positions, sinks, kv_cache, entry_cache, block_table, window_table,
                          cu_seqlens_q, context_lens, scale, window, rate, selected, block_size):
    out = torch.zeros_like(q)
    for r, start, end, context in _requests(cu_seqlens_q, context_lens):
        pos = positions[0, start:end].to(torch.int64)
        table, raw_table = block_table[r], window_table[r]
        _write(kv_cache, paged_slots(raw_table, pos, kv_cache.shape[1]), kv[0, 0, start:end])
        _write_entries(entry_cache, table, entries[0, start:end], pos, rate, block_size)
        first = max(int(pos.min()) - window + 1, 0)
        raw_pos = torch.arange(first, int(pos.max()) + 1, device=pos.device)
        count = (context + end - start) // rate
        keys = torch.cat([_read(kv_cache, paged_slots(raw_table, raw_pos, kv_cache.shape[1])),
                          _read(entry_cache, entry_slots(table, torch.arange(count, device=pos.device), rate, block_size))])
        p = pos.unsqueeze(1)
        in_window = (raw_pos.unsqueeze(0) <= p) & (raw_pos.unsqueeze(0) > p - window)
        readable = _visible(pos, count, rate)
        if selected is not None and count:  # CSA: only the top-k entries (-1: none): O(n·(count + k))
            chosen = selected[0, start:end]
            picked = torch.zeros(readable.shape, dtype=torch.int32, device=readable.device)
            picked.scatter_add_(1, chosen.clamp(min=0), (chosen >= 0).to(torch.int32))
            readable &= picked > 0
        keys = keys.to(q.dtype)
        o, lse = attend_selected(q[0, :, start:end].transpose(0, 1), keys, keys,
                                 torch.cat([in_window, readable], dim=1), scale)
        out[0, :, start:end] = with_sinks(o, lse, sinks).transpose(0, 1)
    return out


def _compress_windows_fake(kv, gate, position_bias, open_windows, state_slots, cu_seqlens_q, context_lens, rate,
                           overlap):
    return kv.new_empty((*kv.shape[:2], kv.shape[-1] // 2 if overlap else kv.shape[-1]))


def _compressed_topk_fake(index_q, weights, index_keys, positions, index_cache, block_table, cu_seqlens_q,
                          context_lens, scale, rate, topk, block_size):
    return index_q.new_empty((*index_q.shape[:2], topk), dtype=torch.int64)


def _compressed_attention_fake(q, kv, entries, positions, sinks, kv_cache, entry_cache, block_table, window_table,
                               cu_seqlens_q, context_lens, scale, window, rate, selected, block_size):
    return torch.empty_like(q)


for _name, _kernel, _fake in (("compress_windows_", compress_windows_, _compress_windows_fake),
                              ("compressed_topk_", compressed_topk_, _compressed_topk_fake),
                              ("compressed_attention_", compressed_attention_, _compressed_attention_fake)):
    _lib.impl(_name, _kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NS}::{_name}", _fake, lib=_lib)
