"""The per-rank byte formula of V4's compressed caches (``dcpgraph.plan.compressed_cache``)
against what :class:`ShardedCompressedCache` and the compressor stream actually hold after
running a request through them."""

from __future__ import annotations

from fractions import Fraction

import dsv4_models
import pytest
import torch

from dcpgraph.ops.compressed_attention import ShardedCompressedCache
from dcpgraph.ops.compressor import compress_stream, open_window
from dcpgraph.plan.compressed_cache import compressed_cache_bytes

DT = torch.float32  # 4 bytes per element


def _held_bytes(cfg, context, dcp, interleave, step):
    """Run ``context`` tokens through one cache and compressor per layer → (largest rank's raw
    window bytes, largest rank's entry + indexer-key bytes, open-window state bytes)."""
    d, di = cfg.head_dim, cfg.index_head_dim
    raw_bytes, entry_bytes = [0] * dcp, [0] * dcp
    state_bytes = 0
    for kind in cfg.layer_types:
        csa = kind == "compressed_sparse_attention"
        rate = cfg.compress_rates.get(kind, 1)
        cache = ShardedCompressedCache(dcp=dcp, window=cfg.sliding_window, rate=rate, head_dim=d,
                                       index_dim=di if csa else 0, interleave=interleave, dtype=DT)
        widths = [2 * d, 2 * di] if csa else ([d] if kind != "sliding_attention" else [])
        states = [open_window(wd, dtype=DT) for wd in widths]
        for start in range(0, context, step):
            n = min(step, context - start)
            cache.append_tokens(torch.arange(start, start + n), torch.zeros(n, d, dtype=DT))
            pooled = []
            for i, wd in enumerate(widths):
                out, states[i] = compress_stream(states[i], torch.zeros(n, wd, dtype=DT), torch.zeros(n, wd, dtype=DT),
                                                 torch.zeros(rate, wd, dtype=DT), rate=rate, overlap=csa)
                pooled.append(out)
            if pooled:
                first = states[0].entries - pooled[0].shape[0]
                cache.append_entries(first, pooled[0], pooled[1] if csa else None)
            cache.drop_unreachable(start + n)
        for rank, (raw, entries) in enumerate(cache.held_rows()):
            raw_bytes[rank] += 4 * raw * d
            entry_bytes[rank] += 4 * entries * (d + (di if csa else 0))
        for s in states:
            state_bytes += 4 * (s.kv.numel() + s.gate.numel())
            if s.carry_kv is not None:
                state_bytes += 4 * (s.carry_kv.numel() + s.carry_gate.numel())
    return max(raw_bytes), max(entry_bytes), state_bytes


@pytest.mark.parametrize(("dcp", "interleave", "context"), [(1, 1, 47), (2, 1, 47), (4, 2, 61), (3, 1, 39)])
def test_formula_matches_what_the_cache_holds(dcp, interleave, context):
    cfg = dsv4_models.config()
    formula = compressed_cache_bytes(cfg, context_tokens=context, dcp=dcp, interleave=interleave, element_bytes=4)
    raw, entries, state = _held_bytes(cfg, context, dcp, interleave, step=5)
    assert formula.compressed + formula.indexer == entries  # entries are a prefix: rank 0 holds the most
    assert raw <= formula.window  # the window's share is a bound over where the window sits
    # The open windows are at most their bound, reached for some context: check the bound holds
    # and is met at a context one short of every rate's multiple.
    assert state <= formula.open_windows
    _, _, full_state = _held_bytes(cfg, 4 * 5 - 1, 1, 1, step=19)  # 19 = −1 mod 2 and mod 4
    assert full_state == formula.open_windows


@pytest.mark.parametrize(("dcp", "interleave"), [(1, 1), (2, 1), (3, 1), (4, 2)])
def test_window_bound_is_met(dcp, interleave):
    """Some context puts the largest share of the last ``W − 1`` tokens on one rank."""
    cfg = dsv4_models.config()
    formula = compressed_cache_bytes(cfg, context_tokens=0, dcp=dcp, interleave=interleave, element_bytes=4)
    seen = max(_held_bytes(cfg, context, dcp, interleave, step=3)[0] for context in range(20, 20 + dcp * interleave))
    assert seen == formula.window


def test_per_token_bytes_fall_by_dcp():
    cfg = dsv4_models.config()
    one = compressed_cache_bytes(cfg, context_tokens=4096, dcp=1, element_bytes=2)
    four = compressed_cache_bytes(cfg, context_tokens=4096, dcp=4, element_bytes=2)
    d, di = cfg.head_dim, cfg.index_head_dim
    expected = Fraction(2 * d, 4) * 2 + Fraction(2 * (d + di), 2)  # two HCA layers (m=4), one CSA (m=2)
    assert one.per_token == expected and four.per_token == expected / 4
    assert four.compressed * 4 == one.compressed and four.indexer * 4 == one.indexer
    assert four.open_windows == one.open_windows  # replicated state, not sharded


def test_formula_on_the_full_size_config():
    """DeepSeek-V4's default config (bf16 cache, fp8 indexer keys as upstream stores them)."""
    import transformers

    cfg = transformers.DeepseekV4Config()
    got = compressed_cache_bytes(cfg, context_tokens=1 << 20, dcp=8, element_bytes=2, index_element_bytes=1)
    kinds = cfg.layer_types
    csa, hca = kinds.count("compressed_sparse_attention"), kinds.count("heavily_compressed_attention")
    expected = Fraction(csa * (512 * 2 + 128), 4 * 8) + Fraction(hca * 512 * 2, 128 * 8)
    assert got.per_token == expected


def test_rejects_a_negative_context():
    with pytest.raises(ValueError, match="context_tokens"):
        compressed_cache_bytes(dsv4_models.config(), context_tokens=-1)
