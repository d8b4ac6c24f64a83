"""Recurrent state under speculative decoding: snapshot before a verification step, restore and
replay the kept tokens after it.

A verification step runs a request's last token and its ``d`` drafts (``1 + d`` tokens, or
``q = 1 + k`` in a verification bucket, which pads the row after its real tokens) through the
model, so every recurrent layer's state in the request's slot ends past all of them. Only
``1 + a`` of them are kept (``a`` drafts accepted). Attention layers need nothing (their KV past
the kept tokens is overwritten later); a recurrent layer's state must be the state after exactly
the kept tokens. The runtime keeps it so (snapshot-and-replay):

1. every state pool has ``S`` more rows after the ``S`` request slots
   (``Lowering.state_snapshots = S``); before a step that carries drafts, slot ``s`` of every row
   with a slot is copied to row ``S + s`` of every pool (the state before the step);
2. after verification, a row that ran ``n`` tokens of which ``m < n`` are kept is restored
   (row ``S + s`` copied back to ``s``) and its ``m`` kept tokens run again in a replay step
   whose logits are dropped. Rows that kept everything they ran (every draft accepted, no bucket
   padding) are left as they are.

Both copies travel as the step input ``state_copies`` ``[n, 2]`` (source row, destination row),
shipped to every rank with the step's other inputs and applied by each rank's executor to each of
its pools before the step's graph runs (:func:`apply_state_copies`), so the acceptance decision
reaches every rank with the replay step that depends on it. The replay rewrites the kept tokens'
KV with the values they already had.

Cost: one more slot of state per request (``bytes_per_request`` of
:mod:`dcpgraph.recurrent_state` again), two row copies per verified request, and one more forward
of ``1 + a`` tokens for every row that rejected a draft (or was padded).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ..program import Program
from .step_inputs import Chunk

STATE_COPIES = "state_copies"
"""The step input ``[n, 2]`` int64 of (source row, destination row) pairs copied in every pool."""


def snapshot_rows(program: Program) -> int:
    """``S``: the request slots of each pool, and the offset of their snapshot rows."""
    return int(program.lowering.state_slots or 0)


def keeps_snapshots(program: Program) -> bool:
    """Whether ``program``'s pools have a snapshot row per slot (a hybrid compiled for speculation)."""
    return bool(program.recurrent_states) and bool(program.lowering.state_snapshots)


def pool_rows(program: Program) -> int:
    """Rows of each of ``program``'s state pools: the slots, their snapshots when kept, and the
    prefix-cache rows with prefix caching (:mod:`.state_prefix_cache`)."""
    lowering = program.lowering
    return int(lowering.state_slots or 0) + int(lowering.state_snapshots or 0) + int(lowering.state_prefix_rows or 0)


def snapshot_copies(chunks: Sequence[Chunk], slots: int) -> torch.Tensor | None:
    """``(s, S + s)`` for every chunk's slot ``s``; ``None`` when no chunk has one."""
    pairs = [(c.state_slot, slots + c.state_slot) for c in chunks if c.state_slot is not None]
    return torch.tensor(pairs, dtype=torch.int64) if pairs else None


def restore_copies(chunks: Sequence[Chunk], slots: int) -> torch.Tensor:
    """``(S + s, s)`` for every chunk's slot ``s``."""
    return torch.tensor([(slots + c.state_slot, c.state_slot) for c in chunks], dtype=torch.int64)


def replay_chunks(ran: Sequence[Chunk], kept_tokens: Sequence[int], processed: Sequence[int]) -> list[Chunk]:
    """The chunks to run again after a restore: for each row with a state slot that ran
    ``processed[i]`` tokens but keeps only ``kept_tokens[i]`` of them, its first ``kept_tokens[i]``
    tokens from its start (one logits row, dropped)."""
    return [replace(c, tokens=c.tokens[:kept], logits_rows=1)
            for c, kept, n in zip(ran, kept_tokens, processed, strict=True)
            if c.state_slot is not None and kept < n]


def apply_state_copies(program: Program, caches: dict[str, torch.Tensor], copies: torch.Tensor | None) -> None:
    """``pool[dst] = pool[src]`` for every ``(src, dst)`` row of ``copies`` and every recurrent
    pool in ``caches`` (one rank's). Sources are read before any destination is written."""
    if copies is None or copies.numel() == 0:
        return
    for spec in program.recurrent_states:
        pool = caches[spec.name]
        copies_here = copies.to(pool.device)
        pool.index_copy_(0, copies_here[:, 1], pool.index_select(0, copies_here[:, 0]))
