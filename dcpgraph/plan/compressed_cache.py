"""Per-rank cache bytes of DeepSeek-V4's compressed attention, from its HF config.

Every V4 attention layer keeps a raw sliding window of ``W = sliding_window`` tokens (one KV head
of ``D = head_dim``, keys = values). A compressed layer of rate ``m`` (``compress_rates`` by
``layer_types``) also keeps one entry of ``D`` per ``m`` tokens, and a compressed sparse (CSA)
layer one indexer key of ``Di = index_head_dim`` per entry. Under DCP over ``N`` ranks with
interleave ``I``, raw token ``t`` and entry ``w`` live on ``owner = (· // I) % N``
(:mod:`dcpgraph.ops.compressed_attention`), so for a context of ``L`` tokens a rank holds at most::

    window rows     share(W − 1)               share(n) = (n // (N·I))·I + min(n mod (N·I), I)
    entries         share(L // m)              (layout.max_local_len)
    bytes           Σ_layers  D·b·share(W − 1)  +  (D·b + Di·bi)·share(L // m)   (Di only for CSA)

between steps (a step of ``n`` new tokens adds at most ``share(n)`` raw rows until its end), with
``b``/``bi`` the element bytes of the cache and of the indexer keys. Per token and rank, as
``L`` grows, that is ``Σ_compressed layers (D·b + Di·bi) / (m·N)``: the raw window is a per-request
constant. The compressors' open windows are per-request state on every rank of the group (not
sharded): ``(m − 1)`` source rows of values and gates of the projection width (``D``, or ``2D``
and ``2Di`` for CSA's compressor and indexer) plus, for CSA, the last closed window's carry
(``m`` rows of values and gates of ``D`` and of ``Di``).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from ..capacity import FP8_SCALE_BYTES, scale_groups
from ..layout import max_local_len

COMPRESSED_KINDS = ("compressed_sparse_attention", "heavily_compressed_attention")


@dataclass(frozen=True)
class CompressedCacheBytes:
    """One rank's bytes for one request of ``context_tokens`` tokens (all layers)."""

    window: int  # raw sliding-window rows, between steps
    compressed: int  # compressed entries
    indexer: int  # CSA indexer keys
    open_windows: int  # compressor state, replicated on every rank of the group
    per_token: Fraction  # compressed + indexer bytes per context token as the context grows

    @property
    def total(self) -> int:
        return self.window + self.compressed + self.indexer + self.open_windows


def _get(config, name):
    return config[name] if isinstance(config, dict) else getattr(config, name)


def compressed_cache_bytes(config, *, context_tokens: int, dcp: int = 1, interleave: int = 1,
                           element_bytes: int = 2, index_element_bytes: int | None = None,
                           fp8_scales: bool = False, state_element_bytes: int | None = None) -> CompressedCacheBytes:
    """The formula of this module for a ``DeepseekV4Config`` (or its dict). ``fp8_scales``: every
    cached row also holds its fp32 scales (``kv_cache_dtype="fp8_e4m3"``, rows packed as
    :mod:`dcpgraph.ops.fp8_rows` says: ``4·ceil(D/128)`` bytes more a row); the open windows are
    kept in the model's dtype, ``state_element_bytes`` (default ``element_bytes``)."""
    if context_tokens < 0:
        raise ValueError(f"context_tokens must be >= 0, got {context_tokens}")
    d, di, w = int(_get(config, "head_dim")), int(_get(config, "index_head_dim")), int(_get(config, "sliding_window"))
    scales = (lambda dim: FP8_SCALE_BYTES * scale_groups(dim)) if fp8_scales else (lambda dim: 0)
    row = d * element_bytes + scales(d)  # the D·b of the module docstring
    index_row = di * (element_bytes if index_element_bytes is None else index_element_bytes) + scales(di)
    b = element_bytes if state_element_bytes is None else state_element_bytes
    rates = dict(_get(config, "compress_rates"))
    window = compressed = indexer = state = 0
    per_token = Fraction(0)
    for kind in _get(config, "layer_types"):
        window += row * max_local_len(w - 1, dcp, interleave)
        if kind not in COMPRESSED_KINDS:
            continue
        m = int(rates[kind])
        entries = max_local_len(context_tokens // m, dcp, interleave)
        compressed += row * entries
        per_token += Fraction(row, m * dcp)
        if kind == "compressed_sparse_attention":
            indexer += index_row * entries
            per_token += Fraction(index_row, m * dcp)
            state += (m - 1) * 2 * (2 * d + 2 * di) * b + m * 2 * (d + di) * b
        else:
            state += (m - 1) * 2 * d * b
    return CompressedCacheBytes(window, compressed, indexer, state, per_token)
