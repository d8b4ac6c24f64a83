"""Where each token of a sequence lives when its KV cache is sharded over ``dcp`` ranks.

With ``N = dcp`` and interleave ``I`` (``cp_kv_cache_interleave_size``), tokens are dealt out to the
ranks of a DCP group in runs of ``I``::

    owner(t)        = (t // I) % N
    local_index(t)  = (t // (N·I))·I + t % I          # position in the owner's local stream
    global_index(j, r) = (j // I)·N·I + r·I + j % I   # inverse of (owner, local_index)
    local_len(L, r) = base + clip(L − base·N − r·I, 0, I),   base = (L // (I·N))·I

Invariant used everywhere downstream: a prefix ``[0, L)`` of global positions is exactly the prefix
``[0, local_len(L, r))`` of rank ``r``'s local stream. So "the context of a request" on a rank is the
first ``local_len(context_len, r)`` local slots, and the causal bound of a query at global position
``p`` on rank ``r`` is ``local_len(p + 1, r)``.

Paged cache: every rank has physical blocks of ``block_size`` tokens; the scheduler deals in
*virtual blocks* of ``block_size·N`` tokens, and one block table (virtual block → physical block id)
is shared by all ranks of the group. Physical block ``b`` on rank ``r`` holds rank ``r``'s share of
virtual block ``b``. Requires ``block_size % I == 0``, so every virtual block holds the same number
of tokens of every rank. The owner writes token ``t`` at::

    slot(t) = table[t // (B·N)]·B + ((t % (B·N)) // (N·I))·I + t % I

and every other rank gets slot −1 (skip the write).

All functions accept Python ints or integer tensors (broadcasting elementwise, no Python loops).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import ConfigError

IntOrTensor = int | torch.Tensor


def _check(dcp: int, interleave: int) -> None:
    if not isinstance(dcp, int) or dcp < 1:
        raise ConfigError(f"dcp must be a positive int, got {dcp!r}")
    if not isinstance(interleave, int) or interleave < 1:
        raise ConfigError(f"interleave must be a positive int, got {interleave!r}")


def owner(t: IntOrTensor, dcp: int, interleave: int = 1) -> IntOrTensor:
    """DCP rank that stores global token ``t``: ``(t // I) % N``."""
    _check(dcp, interleave)
    return (t // interleave) % dcp


def local_index(t: IntOrTensor, dcp: int, interleave: int = 1) -> IntOrTensor:
    """Index of global token ``t`` in its owner's local stream: ``(t // (N·I))·I + t % I``."""
    _check(dcp, interleave)
    return (t // (dcp * interleave)) * interleave + t % interleave


def global_index(j: IntOrTensor, rank: IntOrTensor, dcp: int, interleave: int = 1) -> IntOrTensor:
    """Global position of local token ``j`` of rank ``rank``: ``(j // I)·N·I + r·I + j % I``."""
    _check(dcp, interleave)
    return (j // interleave) * dcp * interleave + rank * interleave + j % interleave


def local_len(length: IntOrTensor, rank: IntOrTensor, dcp: int, interleave: int = 1) -> IntOrTensor:
    """How many of the global positions ``[0, L)`` rank ``r`` owns.

    ``base + clip(L − base·N − r·I, 0, I)`` with ``base = (L // (I·N))·I``.
    """
    _check(dcp, interleave)
    base = (length // (interleave * dcp)) * interleave
    rem = length - base * dcp - rank * interleave
    if isinstance(rem, torch.Tensor):
        return base + rem.clamp(0, interleave)
    return base + min(max(rem, 0), interleave)


def max_local_len(length: IntOrTensor, dcp: int, interleave: int = 1) -> IntOrTensor:
    """The largest ``local_len(L, r)`` over ranks, exactly: rank 0's share,
    ``(L // (N·I))·I + min(L mod (N·I), I)``. Rank 0 owns the first ``I`` positions of every round
    of ``N·I``, so no rank owns more. It equals ``ceil(L / (N·I))·I`` only when ``L mod (N·I)`` is
    0 or at least ``I`` (``L = 1, N = 2, I = 4``: 1, not 4)."""
    return local_len(length, 0, dcp, interleave)


def slot_mapping(
    positions: torch.Tensor,
    block_table_rows: torch.Tensor,
    rank: int,
    dcp: int,
    block_size: int,
    interleave: int = 1,
) -> torch.Tensor:
    """Physical cache slot of each token on DCP rank ``rank``, or −1 where the rank does not own it.

    ``positions[i]`` is the global position of token ``i`` within its request, and
    ``block_table_rows[i]`` is that request's row of the shared block table (virtual block index →
    physical block id). Returns an int64 tensor shaped like ``positions``.

    ``rank`` is the rank's position inside its DCP group (``Mesh.dcp_rank``), not its global rank.
    Raises :class:`ConfigError` when ``block_size < 1``, ``block_size % interleave != 0``, or an
    int ``rank`` lies outside ``[0, dcp)`` (which would otherwise silently skip every write).
    """
    check_slot_args(rank, dcp, block_size, interleave)
    positions = positions.to(torch.int64)
    virtual = block_size * dcp
    vblock = positions // virtual
    offset = positions % virtual
    physical = torch.gather(block_table_rows.to(torch.int64), -1, vblock.unsqueeze(-1)).squeeze(-1)
    slot = physical * block_size + (offset // (dcp * interleave)) * interleave + offset % interleave
    owned = (offset // interleave) % dcp == rank
    return torch.where(owned, slot, torch.full_like(slot, -1))


def check_slot_args(rank: int, dcp: int, block_size: int, interleave: int = 1) -> None:
    """The :class:`ConfigError` checks of :func:`slot_mapping` (and of :func:`slot_of`'s callers)."""
    _check(dcp, interleave)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
    if isinstance(rank, int) and not 0 <= rank < dcp:
        raise ConfigError(f"rank {rank} is outside the DCP group: valid ranks are 0..{dcp - 1}")
    if block_size % interleave:
        raise ConfigError(
            f"block_size ({block_size}) must be a multiple of interleave ({interleave}); "
            f"nearest valid interleave: {_nearest_divisor(block_size, interleave)}"
        )


def slot_of(position: int, table_row: Sequence[int], rank: int, dcp: int, block_size: int, interleave: int = 1) -> int:
    """:func:`slot_mapping` of one token in Python ints (a decode step's few tokens cost less this
    way than as a dozen small tensor ops). Arguments unchecked: check once with :func:`check_slot_args`."""
    virtual = block_size * dcp
    offset = position % virtual
    if (offset // interleave) % dcp != rank:
        return -1
    return table_row[position // virtual] * block_size + (offset // (dcp * interleave)) * interleave + offset % interleave


def _nearest_divisor(n: int, near: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: (abs(d - near), -d))
