"""DeepSeek-V4 compressed attention: the compressor stream, the DCP-sharded cache with its sharded
top-k and sink-once merge, against hand-written dense references; and whole-model greedy tokens
against HF's own ``generate`` (``tests/dsv4_models.py``) under chunked prefill and emulated DCP."""

from __future__ import annotations

import pytest
import torch

from dcpgraph import layout
from dcpgraph.ops.compressed_attention import ShardedCompressedCache, with_sinks
from dcpgraph.ops.compressor import compress_stream, open_window, visible_entries
from dcpgraph.ops.sparse_kernels import index_scores, select_topk

DT = torch.float64


def _pool_by_hand(kv, gate, bias, rate, overlap):
    """Entry w, one window at a time, straight from the formula."""
    entries = []
    width = kv.shape[1]
    half = width // 2
    for w in range(kv.shape[0] // rate):
        rows = slice(w * rate, (w + 1) * rate)
        if not overlap:
            weights = torch.softmax((gate[rows] + bias).float(), dim=0).to(kv.dtype)
            entries.append((weights * kv[rows]).sum(0))
            continue
        slot_kv, slot_gate = [kv[rows, half:]], [gate[rows, half:] + bias[:, half:]]
        if w > 0:
            prev = slice((w - 1) * rate, w * rate)
            slot_kv.insert(0, kv[prev, :half])
            slot_gate.insert(0, gate[prev, :half] + bias[:, :half])
        weights = torch.softmax(torch.cat(slot_gate).float(), dim=0).to(kv.dtype)
        entries.append((weights * torch.cat(slot_kv)).sum(0))
    return torch.stack(entries) if entries else kv.new_empty(0, half if overlap else width)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("rate", [1, 3, 4])
def test_compress_stream_any_split_matches_the_formula(overlap, rate):
    gen = torch.Generator().manual_seed(rate + 10 * overlap)
    width, length = 6, 23
    kv, gate = torch.randn(length, width, generator=gen, dtype=DT), torch.randn(length, width, generator=gen, dtype=DT)
    bias = torch.randn(rate, width, generator=gen, dtype=DT)
    expected = _pool_by_hand(kv, gate, bias, rate, overlap)
    for cuts in ([length], [1] * length, [5, 2, 7, 9], [rate, rate + 1, length - 2 * rate - 1]):
        state, got, start = open_window(width, dtype=DT), [], 0
        for n in cuts:
            pooled, state = compress_stream(state, kv[start:start + n], gate[start:start + n], bias,
                                            rate=rate, overlap=overlap)
            got.append(pooled)
            start += n
        assert state.entries == length // rate and state.kv.shape[0] == length % rate < rate
        torch.testing.assert_close(torch.cat(got), expected, rtol=1e-12, atol=1e-12)


def test_compress_stream_rejects_bad_settings():
    state = open_window(5, dtype=DT)
    with pytest.raises(ValueError, match="2·head_dim"):
        compress_stream(state, torch.zeros(4, 5, dtype=DT), torch.zeros(4, 5, dtype=DT), torch.zeros(2, 5, dtype=DT),
                        rate=2, overlap=True)
    with pytest.raises(ValueError, match="positive int"):
        compress_stream(state, torch.zeros(4, 5, dtype=DT), torch.zeros(4, 5, dtype=DT), torch.zeros(2, 5, dtype=DT),
                        rate=0, overlap=False)


def _dense_reference(q, positions, raw, entries, sinks, *, window, rate, scale, selected=None):
    """HF's eager formula: scores over [window keys | visible entries | sink], softmax, drop sink."""
    t = positions.unsqueeze(1)
    raw_pos = torch.arange(raw.shape[0]).unsqueeze(0)
    ent = torch.arange(entries.shape[0]).unsqueeze(0)
    see_raw = (raw_pos <= t) & (raw_pos > t - window)
    see_ent = ent < visible_entries(positions, rate).unsqueeze(1)
    if selected is not None:
        see_ent &= (ent.unsqueeze(-1) == selected.unsqueeze(1)).any(-1)
    keys = torch.cat([raw, entries])
    scores = torch.einsum("thd,kd->thk", q, keys) * scale
    scores = scores.masked_fill(~torch.cat([see_raw, see_ent], 1).unsqueeze(1), float("-inf"))
    logits = torch.cat([scores, sinks.view(1, -1, 1).expand(q.shape[0], -1, 1)], -1)
    probs = torch.softmax(logits, -1)[..., :-1]
    return torch.einsum("thk,kd->thd", probs, keys)


def _filled_cache(dcp, interleave, raw, entries, index_keys=None, *, window, rate, steps):
    cache = ShardedCompressedCache(dcp=dcp, window=window, rate=rate, head_dim=raw.shape[1],
                                   index_dim=0 if index_keys is None else index_keys.shape[1],
                                   interleave=interleave, dtype=DT)
    for start in range(0, raw.shape[0], steps):
        cache.append_tokens(torch.arange(start, min(start + steps, raw.shape[0])), raw[start:start + steps])
    first = 0
    for start in range(0, entries.shape[0], 3):
        part = slice(start, start + 3)
        cache.append_entries(first, entries[part], None if index_keys is None else index_keys[part])
        first += entries[part].shape[0]
    return cache


@pytest.mark.parametrize(("dcp", "interleave"), [(1, 1), (2, 1), (3, 1), (4, 2)])
def test_sharded_attention_matches_dense_with_sink_once(dcp, interleave):
    gen = torch.Generator().manual_seed(dcp * 7 + interleave)
    heads, dim, length, window, rate = 3, 8, 19, 5, 4
    raw = torch.randn(length, dim, generator=gen, dtype=DT)
    entries = torch.randn(length // rate, dim, generator=gen, dtype=DT)
    sinks = torch.randn(heads, generator=gen, dtype=DT)
    positions = torch.tensor([0, 3, 4, 11, 15, 18])
    q = torch.randn(positions.numel(), heads, dim, generator=gen, dtype=DT)
    cache = _filled_cache(dcp, interleave, raw, entries, window=window, rate=rate, steps=4)
    expected = _dense_reference(q, positions, raw, entries, sinks, window=window, rate=rate, scale=0.3)
    torch.testing.assert_close(cache.attend(q, positions, sinks, scale=0.3), expected, rtol=1e-12, atol=1e-12)
    for rank, shard in enumerate(cache.shards):
        assert bool((layout.owner(shard.entry_indices, dcp, interleave) == rank).all())
    held = sum(e for _, e in cache.held_rows())
    assert held == entries.shape[0] and max(e for _, e in cache.held_rows()) <= -(-entries.shape[0] // dcp) + interleave


def test_with_sinks_of_an_empty_row_is_zero():
    out = torch.full((1, 2, 3), float("nan"), dtype=DT)
    lse = torch.full((1, 2), float("-inf"), dtype=DT)
    assert torch.equal(with_sinks(torch.zeros_like(out), lse, torch.zeros(2, dtype=DT)), torch.zeros_like(out))


@pytest.mark.parametrize(("dcp", "interleave"), [(1, 1), (2, 1), (4, 1), (3, 2)])
def test_sharded_topk_matches_dense_selection(dcp, interleave):
    gen = torch.Generator().manual_seed(40 + dcp + interleave)
    index_heads, index_dim, dim, length, rate, topk = 4, 6, 8, 40, 2, 3
    raw = torch.randn(length, dim, generator=gen, dtype=DT)
    entries = torch.randn(length // rate, dim, generator=gen, dtype=DT)
    keys = torch.randn(length // rate, index_dim, generator=gen, dtype=DT)
    positions = torch.tensor([0, 1, 5, 8, 21, 39])
    iq = torch.randn(positions.numel(), index_heads, index_dim, generator=gen, dtype=DT)
    weights = torch.randn(positions.numel(), index_heads, generator=gen, dtype=DT)
    cache = _filled_cache(dcp, interleave, raw, entries, keys, window=4, rate=rate, steps=7)
    dense = index_scores(iq, keys, weights, 0.5)
    visible = torch.arange(keys.shape[0]).unsqueeze(0) < visible_entries(positions, rate).unsqueeze(1)
    _, expected = select_topk(dense.masked_fill(~visible, float("-inf")), topk)
    got = cache.select(iq, weights, positions, topk=topk, scale=0.5)
    assert torch.equal(got, expected)
    assert bool((got[0] == -1).all()) and int((got[1] >= 0).sum()) == 1  # p=0 sees no entry, p=1 only entry 0
    sinks = torch.zeros(2, dtype=DT)
    q = torch.randn(positions.numel(), 2, dim, generator=gen, dtype=DT)
    torch.testing.assert_close(
        cache.attend(q, positions, sinks, scale=0.4, selected=got),
        _dense_reference(q, positions, raw, entries, sinks, window=4, rate=rate, scale=0.4, selected=expected),
        rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("dcp", "interleave"), [(1, 1), (2, 1), (4, 2)])
def test_raw_window_rows_per_rank_are_bounded_by_the_window(dcp, interleave):
    window, dim = 7, 4
    cache = ShardedCompressedCache(dcp=dcp, window=window, rate=4, head_dim=dim, interleave=interleave, dtype=DT)
    group = dcp * interleave
    bound = (window - 1) // group * interleave + min((window - 1) % group, interleave)
    for start in range(0, 60, 3):
        positions = torch.arange(start, start + 3)
        cache.append_tokens(positions, torch.zeros(3, dim, dtype=DT))
        cache.drop_unreachable(start + 3)
        assert max(w for w, _ in cache.held_rows()) <= bound
        assert sum(w for w, _ in cache.held_rows()) == min(window - 1, start + 3)


def test_cache_rejects_bad_settings():
    with pytest.raises(ValueError, match="window and rate"):
        ShardedCompressedCache(dcp=1, window=0, rate=4, head_dim=4)
    cache = ShardedCompressedCache(dcp=2, window=4, rate=4, head_dim=4)
    with pytest.raises(ValueError, match="indexer"):
        cache.append_entries(0, torch.zeros(1, 4), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="no indexer"):
        cache.select(torch.zeros(1, 1, 2), torch.zeros(1, 1), torch.tensor([3]), topk=1, scale=1.0)


@pytest.mark.parametrize(("dcp", "interleave", "block"), [(1, 1, 4), (2, 1, 2), (4, 2, 4), (3, 1, 3)])
def test_entries_fit_a_paged_cache_by_the_slot_rule(dcp, interleave, block):
    """Entries use the token slot rule on entry indices: written by ``layout.slot_mapping`` into a
    paged cache with one block table per request (virtual blocks of ``block·dcp`` entries), rank
    ``r``'s first ``local_len(E, r)`` slots read back exactly what the sharded cache holds."""
    from dcpgraph.ops.paged import gather_paged

    gen = torch.Generator().manual_seed(dcp * 100 + block)
    dim, count = 5, 29
    entries = torch.randn(count, dim, generator=gen, dtype=DT)
    cache = _filled_cache(dcp, interleave, torch.zeros(0, dim, dtype=DT), entries, window=3, rate=2, steps=4)
    virtual = -(-count // (block * dcp))
    table = torch.randperm(virtual + 3, generator=gen)[:virtual]
    indices = torch.arange(count)
    for rank, shard in enumerate(cache.shards):
        paged = torch.full((virtual + 3, block, 1, dim), float("nan"), dtype=DT)
        slots = layout.slot_mapping(indices, table.expand(count, -1), rank, dcp, block, interleave)
        mine = slots >= 0
        paged.view(-1, 1, dim)[slots[mine]] = entries[mine].unsqueeze(1)
        length = int(layout.local_len(count, rank, dcp, interleave))
        assert length == shard.entry_indices.numel()
        read = gather_paged(paged, table.tolist(), length)[:, 0]
        assert torch.equal(read, shard.entry_kv)
