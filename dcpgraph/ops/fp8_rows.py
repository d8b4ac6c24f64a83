"""fp8 cache rows with their scales inside: one ``uint8`` row per cached row, values then scales.

A DeepSeek-V4 compressed cache (:mod:`.compressed_cached`: the raw K=V window, the entries, the
indexer keys) at ``kv_cache_dtype="fp8_e4m3"`` stores a row of ``D`` elements as ``D + 4·G`` bytes,
``G = ceil(D / 128)``::

    [ e4m3 bytes of x_0 … x_{D-1} | fp32 bytes of s_0 … s_{G-1} ]      x_d ≈ fp8_d · s_{d // 128}

with the scale scheme of :mod:`.quant` (per row, per 128-element group, a power of two ``≥ amax / 448``;
exact for every value e4m3 represents after scaling). The scales travel inside the row, as DeepSeek's
own fp8 MLA cache packs them, so every consumer of the cache's rows (the entry placement, the
P/D hand-over, prefix caching, the DCP gather) moves them without knowing the row is packed: the
cache is one tensor and its role, blocks and slots are the unpacked cache's. A row costs
``D + 4·ceil(D/128)`` bytes against ``D·b`` (0.52× bf16 for ``D = 512``).
"""

from __future__ import annotations

import torch

from ..capacity import FP8_SCALE_BYTES, FP8_SCALE_GROUP, scale_groups
from .quant import dequantize_fp8, quantize_fp8

PACKED_DTYPE = torch.uint8


def packed_width(dim: int) -> int:
    """Bytes of a packed row of ``dim`` elements."""
    return dim + FP8_SCALE_BYTES * scale_groups(dim)


def unpacked_dim(width: int) -> int:
    """The ``dim`` whose packed row is ``width`` bytes: with ``G = ceil(D / 128)`` groups a row
    is ``D + 4G`` bytes, in ``(132G − 128, 132G]``, so ``G = ceil(width / 132)``."""
    groups = -(-width // (FP8_SCALE_GROUP + FP8_SCALE_BYTES))
    dim = width - FP8_SCALE_BYTES * groups
    if dim <= 0 or packed_width(dim) != width:
        raise ValueError(f"{width} bytes is no packed fp8 row width")
    return dim


def is_packed(cache: torch.Tensor) -> bool:
    return cache.dtype == PACKED_DTYPE


def pack_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows [n, H, D]`` (any float dtype) → ``[n, H, D + 4·G]`` uint8."""
    q, scales = quantize_fp8(rows)
    return torch.cat([q.view(PACKED_DTYPE), scales.contiguous().view(PACKED_DTYPE)], dim=-1)


def unpack_rows(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_rows`: ``[..., D + 4·G]`` uint8 → ``[..., D]`` in ``dtype``."""
    dim = unpacked_dim(packed.shape[-1])
    values = packed[..., :dim].contiguous().view(torch.float8_e4m3fn)
    scales = packed[..., dim:].contiguous().view(torch.float32)
    return dequantize_fp8(values, scales, dtype)
