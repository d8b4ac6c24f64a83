"""fp8 (``float8_e4m3fn``) KV cache: quantise at cache write, dequantise at cache read.

Scale scheme (per token, per head, per group of ``FP8_SCALE_GROUP`` = 128 elements): a cache
``[NB, B, H, D]`` of fp8 has a companion scale cache ``[NB, B, H, G]`` of fp32 with
``G = ceil(D / 128)``; element ``d`` of row ``(slot, h)`` is ``fp8[slot, h, d] · scale[slot, h, d // 128]``.
A group's scale is the smallest power of two ``2^k ≥ amax(|x|) / 448`` (448 is e4m3fn's largest
finite value; an all-zero group gets scale 1), as OCP's MX formats do with their E8M0 scales:

* a dequantised element ``m · 2^k`` has e4m3's 4 significant bits, so it is exact in bf16 and the
  native AMX kernel makes it by moving an exponent, not by a multiply and a rounding;
* the cost in precision is nil for normal e4m3 values (its relative step is 2^-3 whatever the
  scale) and at most one binade of range at the bottom (amax lands in (224, 448], not on 448);
* ``k`` is clamped to [-117, 119] so every ``m · 2^k`` is a normal bf16/fp32 number.

Why per token rather than per tensor:

* exact under paged writes: a slot's scale is computed from that slot's own values when it is
  written, so writing token ``t`` never changes how an earlier token is read (a per-tensor scale
  would need to be fixed in advance or rewrite the cache when it grows);
* no calibration: there is no global statistic to collect before serving;
* DCP-local: each rank writes the tokens it owns with their scales, nothing is reduced across the
  DCP group, and a KV transfer moves scales with their slots like any other cache.

Cost: 4 bytes per 128 elements (3.1% of the fp8 bytes), the figure the planner
(:mod:`dcpgraph.plan.model_shape`) and :mod:`dcpgraph.capacity` use.

MLA's latent cache ``[c ‖ k_rope]`` (512 + 64) is quantised whole, but the rope part is its own
scale group (the latent fills groups 0-3, the rope group 4), so its range never shares a scale
with the latent's. vLLM keeps the rope part in bf16 inside a byte-packed row; dcpgraph keeps one
dtype per cache tensor so the values stay a view ``cache[..., :512]`` of the key cache, and the
separate rope scale removes the reason to keep it wider (cross-range scale sharing).

Reading: the native paged-decode kernel (:mod:`dcpgraph.ops.native`) reads fp8 blocks in place
through the block table, converting each element and applying its row's scale in registers, so a
decode step moves only the fp8 bytes and their scales. Every other path (a sliding window, a
soft-cap, several query rows under a causal bound, builds without AVX-512) goes through
:func:`dequantized_context`, which dequantises only the blocks a step's block table references
(cost proportional to the context read, never to cache capacity) into a compact cache in the
query's dtype and remaps the table.
"""

from __future__ import annotations

import torch

from ..capacity import FP8_SCALE_GROUP, scale_groups

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Scale exponents: every e4m3 value times 2^k stays a normal bf16/fp32 number (the native kernel
# moves exponents; see the module docstring).
MIN_SCALE_EXP, MAX_SCALE_EXP = -117, 119


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H, D]`` → ``(q [T, H, D] fp8, scales [T, H, G] fp32)``, one scale per 128-group."""
    t, h, d = x.shape
    groups = scale_groups(d)
    padded = torch.nn.functional.pad(x.to(torch.float32), (0, groups * FP8_SCALE_GROUP - d))
    grouped = padded.view(t, h, groups, FP8_SCALE_GROUP)
    amax = grouped.abs().amax(-1)
    scales = torch.where(amax > 0, _power_of_two_at_least(amax / FP8_MAX), torch.ones_like(amax))
    q = (grouped / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).view(t, h, -1)[..., :d]
    return q.to(FP8_DTYPE), scales


def _power_of_two_at_least(x: torch.Tensor) -> torch.Tensor:
    """``2^k`` with ``k = ceil(log2 x)`` clamped to ``[MIN_SCALE_EXP, MAX_SCALE_EXP]`` (fp32, exact)."""
    mantissa, exponent = torch.frexp(x)  # x = m 2^e, 0.5 <= m < 1
    k = torch.where(mantissa == 0.5, exponent - 1, exponent).clamp(MIN_SCALE_EXP, MAX_SCALE_EXP)
    return torch.ldexp(torch.ones_like(x), k)


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8` over any leading shape: ``q [..., D]``, ``scales [..., G]``."""
    d = q.shape[-1]
    expanded = scales.repeat_interleave(FP8_SCALE_GROUP, dim=-1)[..., :d]
    return (q.to(torch.float32) * expanded).to(dtype)


def _select_blocks(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``cache[ids]`` of an fp8 cache, gathered as bytes (aten's CPU index_select has no fp8 kernel)."""
    return cache.view(torch.uint8).index_select(0, ids).view(cache.dtype)


def dequantized_context(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor | None,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k, v, table)``: the blocks the table uses for each row's first ``kv_lens`` tokens,
    dequantised to ``dtype`` into a compact cache, and the table remapped onto it.

    ``v_scales`` None: ``v_cache`` is a prefix view of ``k_cache`` (MLA's latent), and the compact
    values are the same prefix of the compact keys (still a view). Table entries a row does not
    need (past its length, padding) map to compact block 0 and are never read.
    """
    block = k_cache.shape[1]
    width = block_table.shape[1]
    table = block_table.to(torch.int64)
    needed = torch.arange(width, device=table.device).unsqueeze(0) * block < kv_lens.to(table.device).to(torch.int64).unsqueeze(1)
    bad = needed & ((table < 0) | (table >= k_cache.shape[0]))
    if bool(bad.any()):
        raise ValueError(f"paged attention: block ids {table[bad].tolist()} outside the cache's {k_cache.shape[0]} blocks")
    used = torch.unique(table[needed]) if bool(needed.any()) else table.new_zeros(1)
    remap = torch.zeros(k_cache.shape[0], dtype=torch.int64, device=table.device)
    remap[used] = torch.arange(used.numel(), device=table.device)
    compact_table = torch.where(needed, remap[table.clamp(0, k_cache.shape[0] - 1)], 0).to(block_table.dtype)
    k = dequantize_fp8(_select_blocks(k_cache, used), k_scales.index_select(0, used), dtype)
    if v_scales is None:
        v = k[..., : v_cache.shape[-1]]
    else:
        v = dequantize_fp8(_select_blocks(v_cache, used), v_scales.index_select(0, used), dtype)
    return k, v, compact_table
