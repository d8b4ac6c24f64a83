"""KV-cache capacity arithmetic: the one place the per-block byte formula lives.

A rank holds, for every cache of the program (per layer: K and V for GQA, one latent for MLA, and
for sparse attention (DSA) also the indexer's key cache, sharded by the same layout),
a paged tensor ``[num_blocks, block_size, heads, dim]``. With DCP over ``dcp`` ranks the block
manager hands out *virtual* blocks of ``block_size · dcp`` tokens: one physical block on each
rank of the DCP group. Hence, per rank::

    bytes_per_block      = Σ_caches block_size · heads · (dim · element_bytes + scale_bytes_per_head)
    tokens_per_block     = block_size · dcp                  (a virtual block)
    blocks_for(budget)   = budget // bytes_per_block         (at least 1)
    capacity_tokens      = blocks · tokens_per_block
    bytes_per_token      = bytes_per_block / tokens_per_block

``scale_bytes_per_head`` is zero for floating-point caches (bf16/fp16/fp32/fp64); an
``fp8_e4m3`` cache carries one fp32 scale per (token, head, group of ``FP8_SCALE_GROUP``
elements), ``scale_groups(dim) · FP8_SCALE_BYTES`` bytes per head. The compiler keeps those scales
in a companion cache (role ``"<role>_scale"``, ``dim = scale_groups(dim)``, fp32) that
:func:`cache_shapes` folds into its data cache's ``scale_bytes_per_head``, so a compiled program
and the planner's :class:`CacheShape` list give the same bytes (see :mod:`dcpgraph.ops.quant`).
Nothing here depends on a traced program: :func:`cache_shapes` reads anything with ``heads``,
``dim`` and ``dtype`` attributes (the compiler's ``CacheSpec``), and the planner builds
:class:`CacheShape` from a config.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

import torch

KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3")  # vLLM's names; auto = the model's dtype
# vLLM's other spellings of the same caches (its "fp8" is e4m3 on CUDA), taken as the names above.
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "bfloat16": "bf16"}


def canonical_kv_cache_dtype(name: object) -> object:
    """``name`` with vLLM's aliases replaced by dcpgraph's names; anything else unchanged (the
    callers validate it)."""
    return KV_CACHE_DTYPE_ALIASES.get(name, name) if isinstance(name, str) else name


FP8_SCALE_GROUP = 128  # elements per fp32 scale of an fp8 cache (per token and head)
FP8_SCALE_BYTES = 4
SCALE_SUFFIX = "_scale"  # a scale cache's role: its data cache's role + this suffix


def scale_groups(dim: int) -> int:
    """fp32 scales per (token, head) of an fp8 cache row of ``dim`` elements."""
    return math.ceil(dim / FP8_SCALE_GROUP)


@dataclass(frozen=True)
class CacheShape:
    """One per-rank cache: ``heads`` heads of ``dim`` elements per row, plus scale bytes; a row
    holds one token, or ``tokens_per_row`` positions' compressed entry (``ceil(B / m)`` rows per
    block of ``B``)."""

    heads: int
    dim: int
    element_bytes: int
    scale_bytes_per_head: int = 0
    tokens_per_row: int = 1

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one row (of one token when ``tokens_per_row`` is 1)."""
        return self.heads * (self.dim * self.element_bytes + self.scale_bytes_per_head)

    def bytes_per_block(self, block_size: int) -> int:
        return -(-block_size // self.tokens_per_row) * self.bytes_per_token


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def cache_shapes(specs: Iterable) -> list[CacheShape]:
    """``CacheShape`` of each compiler cache spec (``heads``, ``dim``, ``dtype``, ``role``): a
    scale cache (role ending ``"_scale"``) becomes its data cache's ``scale_bytes_per_head``."""
    specs = list(specs)
    scales = {(c.layer, c.role[: -len(SCALE_SUFFIX)]): c for c in specs
              if getattr(c, "role", "").endswith(SCALE_SUFFIX)}
    out = []
    for c in specs:
        if getattr(c, "role", "").endswith(SCALE_SUFFIX):
            continue
        s = scales.get((getattr(c, "layer", None), getattr(c, "role", None)))
        per_head = 0 if s is None else int(s.dim) * element_bytes(s.dtype)
        out.append(CacheShape(int(c.heads), int(c.dim), element_bytes(c.dtype), per_head,
                              int(getattr(c, "tokens_per_row", 1))))
    return out


def bytes_per_block(caches: Iterable[CacheShape], block_size: int) -> int:
    """Bytes of one physical block (``block_size`` tokens) of every cache on one rank."""
    return sum(c.bytes_per_block(block_size) for c in caches)


def tokens_per_block(block_size: int, dcp: int) -> int:
    """Tokens of one virtual block: one physical block on each of the ``dcp`` ranks."""
    return block_size * dcp


def blocks_for_bytes(budget_bytes: int, per_block: int) -> int:
    """Blocks that fit in ``budget_bytes`` per rank (at least one, like the engine)."""
    return max(1, int(budget_bytes) // per_block)


def blocks_for_tokens(tokens: int, block_size: int, dcp: int) -> int:
    """Virtual blocks needed to hold ``tokens`` tokens of one sequence (or a token budget)."""
    return max(1, math.ceil(tokens / tokens_per_block(block_size, dcp)))


def capacity_tokens(num_blocks: int, block_size: int, dcp: int) -> int:
    return num_blocks * tokens_per_block(block_size, dcp)


def bytes_per_token(caches: Iterable[CacheShape], block_size: int, dcp: int) -> Fraction:
    """Per-rank KV bytes per token of context (exact): ``bytes_per_block / (block_size · dcp)``."""
    return Fraction(bytes_per_block(caches, block_size), tokens_per_block(block_size, dcp))


def max_sequences(num_blocks: int, context_tokens: int, block_size: int, dcp: int) -> int:
    """How many sequences of ``context_tokens`` fit at once: each holds whole virtual blocks."""
    return num_blocks // blocks_for_tokens(context_tokens, block_size, dcp)
