"""DeepSeek-V4's cached compressed attention on one rank of a DCP group (``dcp = N > 1``).

With interleave ``I`` (:mod:`dcpgraph.layout`), rank ``r`` holds

* the raw K=V row of token ``t`` iff ``owner(t) = r``, at ``slot_mapping(t)`` with blocks of ``B``
  tokens (virtual blocks of ``B·N`` tokens, the request's block table);
* entry ``w`` (and, for CSA, its indexer key) iff ``owner(w) = r``: the interleave rule on **entry
  indices**, at ``slot_mapping(w)`` with blocks of ``R`` entries, ``R`` the entry cache's rows per
  block (a multiple of ``I``; ``R·m >= B``, so the table row ``w // (R·N)`` exists once entry ``w``
  closes);
* the open windows whole (per-request state, every rank computes the same entries).

==============================================  ==================================================
op                                              meaning
==============================================  ==================================================
``compressed_topk_dcp_(…, dcp_rank, …, dcp,     writes the owned indexer keys of this step's
interleave) -> (values, entries)``              closing rows, scores this rank's entries
                                                ``w < (p + 1) // m`` and keeps its top-``k`` by the
                                                tie rule (score desc, entry index asc) →
                                                ``[1, T, k]`` scores and **global** entry indices
                                                (``−1``: none); ``merge_topk`` of the group's
                                                candidates is the dense top-``k``
``compressed_attention_dcp_(q, …, dcp_rank,     writes the owned raw rows and entries, then for the
…, selected, …) -> (out, lse)``                 group's queries ``q [N·H, T, D]``: one softmax over
                                                this rank's window tokens ``p − W < t <= p`` and its
                                                visible (selected) entries, no sink
``compressed_merge_sinks(outs, lses, sinks)``   ``outs [N, H, T, D]``, ``lses [N, H, T]`` (rank
                                                ``i``'s partial in row ``i``) → ``[1, H, T, D]``::

                                                  lse = logsumexp_i lse_i
                                                  o   = Σ_i exp(lse_i − lse)·o_i
                                                  out = o · exp(lse − logaddexp(lse, s_h))
==============================================  ==================================================

Every key is held by exactly one rank, so the merge is the dense softmax over the window, the
entries and the sink, which joins once, after the merge.
"""

from __future__ import annotations

import torch

from .. import layout
from .compressed import closing_rows
from .compressed_attention import with_sinks
from .compressed_cached import _read, _requests, _write
from .sparse_kernels import (
    INDEX_DTYPE,
    NEG_INF,
    acc_dtype,
    attend_selected,
    index_scores,
    select_topk,
)

NS = "dcpgraph"
_lib = torch.library.Library(NS, "FRAGMENT")
_lib.define("compressed_topk_dcp_(Tensor index_q, Tensor weights, Tensor index_keys, Tensor positions, "
            "Tensor(a!) index_cache, Tensor block_table, Tensor cu_seqlens_q, Tensor context_lens, Tensor dcp_rank, "
            "float scale, int rate, int topk, int dcp, int interleave) -> (Tensor, Tensor)")
_lib.define("compressed_attention_dcp_(Tensor q, Tensor kv, Tensor entries, Tensor positions, "
            "Tensor(a!) kv_cache, Tensor(b!) entry_cache, Tensor block_table, Tensor window_table, "
            "Tensor cu_seqlens_q, Tensor context_lens, Tensor dcp_rank, float scale, int window, int rate, "
            "Tensor? selected, int dcp, int interleave) -> (Tensor, Tensor)")
_lib.define("compressed_merge_sinks(Tensor outs, Tensor lses, Tensor sinks) -> Tensor")


def _slots(table_row: torch.Tensor, indices: torch.Tensor, rank: int, dcp: int, block: int,
           interleave: int) -> torch.Tensor:
    """``layout.slot_mapping`` of one request's ``indices`` (−1 where ``rank`` does not own them)."""
    rows = table_row.unsqueeze(0).expand(indices.shape[0], -1)
    return layout.slot_mapping(indices, rows, rank, dcp, block, interleave)


def _local_indices(lo: int, hi: int, rank: int, dcp: int, interleave: int, device) -> torch.Tensor:
    """The global indices in ``[lo, hi)`` that ``rank`` owns, ascending."""
    first, last = (int(layout.local_len(x, rank, dcp, interleave)) for x in (lo, hi))
    return layout.global_index(torch.arange(first, last, device=device), rank, dcp, interleave)


def _write_owned(cache, table_row, rows, indices, rank, dcp, block, interleave) -> None:
    slots = _slots(table_row, indices, rank, dcp, block, interleave)
    mine = slots >= 0
    if bool(mine.any()):
        _write(cache, slots[mine], rows[mine])


def _write_entries(cache, table_row, rows, positions, rate, rank, dcp, interleave) -> None:
    closes = closing_rows(positions, rate)
    if bool(closes.any()):
        entries = torch.div(positions[closes] + 1, rate, rounding_mode="floor") - 1
        _write_owned(cache, table_row, rows[closes], entries, rank, dcp, cache.shape[1], interleave)


def _local_entries(cache, table_row, count, rank, dcp, interleave):
    """(global indices, rows) of the entries ``[0, count)`` this rank holds."""
    glob = _local_indices(0, count, rank, dcp, interleave, table_row.device)
    return glob, _read(cache, _slots(table_row, glob, rank, dcp, cache.shape[1], interleave))[:, 0]


def compressed_topk_dcp_(index_q, weights, index_keys, positions, index_cache, block_table, cu_seqlens_q,
                         context_lens, dcp_rank, scale, rate, topk, dcp, interleave):
    rank = int(dcp_rank)
    values = torch.full((*index_q.shape[:2], topk), NEG_INF, dtype=INDEX_DTYPE, device=index_q.device)
    chosen = torch.full((*index_q.shape[:2], topk), -1, dtype=torch.int64, device=index_q.device)
    for r, start, end, context in _requests(cu_seqlens_q, context_lens):
        pos = positions[0, start:end].to(torch.int64)
        _write_entries(index_cache, block_table[r], index_keys[0, start:end], pos, rate, rank, dcp, interleave)
        glob, keys = _local_entries(index_cache, block_table[r], (context + end - start) // rate, rank, dcp,
                                    interleave)
        scores = index_scores(index_q[0, start:end], keys, weights[0, start:end], scale)  # [n, E_r]
        visible = glob.unsqueeze(0) < (torch.div(pos + 1, rate, rounding_mode="floor")).unsqueeze(1)
        vals, local = select_topk(scores.masked_fill(~visible, NEG_INF), topk)  # local order = global order
        values[0, start:end] = vals.to(INDEX_DTYPE)
        chosen[0, start:end] = torch.where(local >= 0, glob[local.clamp(min=0)] if glob.numel() else local, -1)
    return values, chosen


def compressed_attention_dcp_(q, kv, entries, positions, kv_cache, entry_cache, block_table, window_table,
                              cu_seqlens_q, context_lens, dcp_rank, scale, window, rate, selected, dcp, interleave):
    rank = int(dcp_rank)
    heads, _, dim = q.shape
    acc = acc_dtype(q.dtype)
    out = q.new_zeros(heads, q.shape[1], dim)
    lse = torch.full((heads, q.shape[1]), NEG_INF, dtype=acc, device=q.device)
    block = kv_cache.shape[1]
    for r, start, end, context in _requests(cu_seqlens_q, context_lens):
        pos = positions[0, start:end].to(torch.int64)
        table, raw_table = block_table[r], window_table[r]
        _write_owned(kv_cache, raw_table, kv[0, 0, start:end], pos, rank, dcp, block, interleave)
        _write_entries(entry_cache, table, entries[0, start:end], pos, rate, rank, dcp, interleave)
        raw_pos = _local_indices(max(int(pos.min()) - window + 1, 0), int(pos.max()) + 1, rank, dcp, interleave,
                                 pos.device)
        raw = _read(kv_cache, _slots(raw_table, raw_pos, rank, dcp, block, interleave))
        glob, held = _local_entries(entry_cache, table, (context + end - start) // rate, rank, dcp, interleave)
        keys = torch.cat([raw, held.unsqueeze(1)]).to(q.dtype)
        p = pos.unsqueeze(1)
        in_window = (raw_pos.unsqueeze(0) <= p) & (raw_pos.unsqueeze(0) > p - window)
        readable = glob.unsqueeze(0) < torch.div(pos + 1, rate, rounding_mode="floor").unsqueeze(1)
        if selected is not None:  # CSA: only the selected entries this rank holds (-1: none)
            chosen = selected[0, start:end]
            readable &= (chosen.unsqueeze(-1) == glob.view(1, 1, -1)).any(1)
        o, s = attend_selected(q[:, start:end].transpose(0, 1), keys, keys, torch.cat([in_window, readable], 1),
                               scale)
        out[:, start:end] = o.transpose(0, 1).to(out.dtype)
        lse[:, start:end] = s.transpose(0, 1).to(acc)
    return out, lse


def compressed_merge_sinks(outs, lses, sinks):
    acc = acc_dtype(outs.dtype)
    lse = torch.logsumexp(lses.to(acc), dim=0)  # [H, T]
    weight = torch.exp(lses.to(acc) - lse.unsqueeze(0)).nan_to_num(0.0)  # a rank with no key: 0
    merged = (outs.to(acc) * weight.unsqueeze(-1)).sum(0)  # [H, T, D]
    return with_sinks(merged.transpose(0, 1), lse.transpose(0, 1), sinks).transpose(0, 1).unsqueeze(0).to(outs.dtype)


def _topk_fake(index_q, weights, index_keys, positions, index_cache, block_table, cu_seqlens_q, context_lens,
               dcp_rank, scale, rate, topk, dcp, interleave):
    return (index_q.new_empty((*index_q.shape[:2], topk), dtype=INDEX_DTYPE),
            index_q.new_empty((*index_q.shape[:2], topk), dtype=torch.int64))


def _attention_fake(q, kv, entries, positions, kv_cache, entry_cache, block_table, window_table, cu_seqlens_q,
                    context_lens, dcp_rank, scale, window, rate, selected, dcp, interleave):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=acc_dtype(q.dtype))


def _merge_fake(outs, lses, sinks):
    return outs.new_empty((1, *outs.shape[1:]))


for _name, _kernel, _fake in (("compressed_topk_dcp_", compressed_topk_dcp_, _topk_fake),
                              ("compressed_attention_dcp_", compressed_attention_dcp_, _attention_fake),
                              ("compressed_merge_sinks", compressed_merge_sinks, _merge_fake)):
    _lib.impl(_name, _kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NS}::{_name}", _fake, lib=_lib)
