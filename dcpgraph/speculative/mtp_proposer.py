"""``MTPProposer``: DeepSeek-V3 MTP drafting (``method="mtp"``) on the target's mesh.

The MTP program (:mod:`.mtp_module`) runs on its own executor with its own KV cache of the
target's number of blocks, addressed by the target's block tables (like
:mod:`.draft_model`): MTP KV for position ``t`` lives where the target's does, on the same DCP
rank, so its attention is sharded by DCP like the main model's.

MTP KV at position ``t`` is defined by ``(token t+1, h_t)``, ``h_t`` the target's final hidden
state (after its final norm) at ``t``. The target program returns ``h`` for every token it
computes; :meth:`MTPProposer.observe` keeps, per request, the rows from the MTP's valid prefix
on (``h_t`` is correct for every ``t < computed``: a rejected draft's row sits at a position
``>= computed`` and is overwritten when the target computes that position again).

``propose`` for a decode row at ``s`` (its last token ``tokens[s]``, ``s = computed``): one
forward over positions ``valid .. s-1`` (ids ``tokens[t+1]``, hidden ``h_t``; split into
forwards of at most ``max_batched_tokens`` tokens) whose last row gives draft 1, then ``k - 1``
one-token steps at positions ``s, s+1, …`` on the previous draft and the MTP's own output
state ``x`` (vLLM's chaining). Those steps write MTP KV from ``x`` rather than ``h``, so only
positions ``< s`` count as valid afterwards; the next call recomputes the rest from the target's
hidden states. A row whose history lacks hidden states (its last chunk of a prompt: ``h_{s-1}``
is computed in this very step; a prefix-cache hit: the target never computed the cached
positions) gets no drafts, which keeps tokens exact and only forgoes speculation. The one-token
drafting steps run in the target's static-shape decode buckets (hidden-state input padded with
zero rows); catch-up forwards run the dynamic graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..runtime.proposer import NO_DRAFTS, Drafts
from ..runtime.step_inputs import Chunk, build_step_inputs
from .draft_model import DraftModelProposer


class MTPProposer:
    method = "mtp"

    def __init__(self, program, executor, max_batched_tokens: int | None = None, buckets=None):
        self.program = program
        self.executor = executor
        self.mesh = program.mesh
        self.block_size = int(program.lowering.block_size)
        self.interleave = int(program.lowering.interleave)
        self.max_batched_tokens = max_batched_tokens
        self.valid: dict[tuple[int, int], int] = {}  # MTP KV prefix per (request id, preemptions)
        self.hidden: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}  # (first position, h rows)
        self.buckets = buckets  # DecodeBuckets for the one-token drafting steps (None: dynamic graph)
        self.steps = 0
        self.graph_steps: dict[str, int] = {}

    @staticmethod
    def _key(request) -> tuple[int, int]:
        return request.id, request.preemptions

    # -- the target's hidden states --------------------------------------------------------------
    def observe(self, plan: Sequence, chunks: Sequence[Chunk], hidden: torch.Tensor) -> None:
        """Keep the target's hidden states of this step's tokens (``hidden`` ``[T, H]`` in the
        order of ``chunks``), replacing any kept for the same positions."""
        row = 0
        for item, chunk in zip(plan, chunks):
            n = len(chunk.tokens)
            rows, row = hidden[row : row + n], row + n
            key = self._key(item.request)
            base, kept = self.hidden.get(key, (chunk.start, rows[:0]))
            if not base <= chunk.start <= base + len(kept):
                base, kept = chunk.start, rows[:0]  # not contiguous with what is kept: start over
            kept = torch.cat([kept[: chunk.start - base], rows])
            drop = max(0, min(self.valid.get(key, 0), chunk.start) - base)
            self.hidden[key] = (base + drop, kept[drop:])
        if len(self.hidden) > 4 * max(1, len(plan)):
            live = {self._key(item.request) for item in plan}
            self.hidden = {k: v for k, v in self.hidden.items() if k in live}
            self.valid = {k: v for k, v in self.valid.items() if k in live}

    def _history(self, item) -> tuple[int, torch.Tensor] | None:
        """``(v, h rows for positions v .. s-1)`` for a decode row at ``s``, or ``None``."""
        s = item.chunk.start
        if len(item.chunk.tokens) != 1 or s < 1:
            return None
        key = self._key(item.request)
        v = min(self.valid.get(key, 0), s - 1)
        base, kept = self.hidden.get(key, (0, None))
        if kept is None or base > v or base + len(kept) < s:
            return None
        return v, kept[v - base : s - base]

    # -- drafting --------------------------------------------------------------------------------
    def propose(self, plan: Sequence) -> list[Drafts]:
        history = {i: self._history(item) for i, item in enumerate(plan) if item.draft_room > 0}
        history = {i: h for i, h in history.items() if h is not None}
        history = self._catch_up(plan, history)
        tokens: dict[int, list[int]] = {i: [] for i in history}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in history}
        live = list(history)
        chunks = [self._chunk(plan[i], history[i][0], plan[i].chunk.start) for i in live]
        inputs = [history[i][1] for i in live]
        step = 0
        while live:
            logits, states = self._run(chunks, inputs)
            for row, i in enumerate(live):
                DraftModelProposer._choose(plan[i], logits[row], tokens[i], probs[i])
            step += 1
            keep = [row for row, i in enumerate(live) if plan[i].draft_room > step]
            live = [live[row] for row in keep]
            chunks = [Chunk(plan[i].request.id, (tokens[i][-1],), plan[i].chunk.start - 1 + step,
                            plan[i].chunk.block_table) for i in live]
            inputs = [states[row : row + 1] for row in keep]
        out = []
        for i, item in enumerate(plan):
            if i not in tokens:
                out.append(NO_DRAFTS)
                continue
            self.valid[self._key(item.request)] = item.chunk.start  # positions < s hold h-based KV
            out.append(Drafts(tokens[i], torch.stack(probs[i]) if probs[i] else None))
        return out

    @staticmethod
    def _chunk(item, start: int, stop: int) -> Chunk:
        """MTP positions ``start .. stop-1``: their input ids are the tokens one position later."""
        return Chunk(item.request.id, tuple(item.request.tokens[start + 1 : stop + 1]), start, item.chunk.block_table)

    def _catch_up(self, plan: Sequence, history: dict[int, tuple[int, torch.Tensor]]):
        """Run positions that do not fit one forward of ``max_batched_tokens`` tokens first, so the
        drafting forward does; returns the histories still to run."""
        budget = self.max_batched_tokens
        while budget is not None and sum(len(h) for _, h in history.values()) > budget:
            chunks, inputs, left = [], [], budget
            for i, (v, rows) in list(history.items()):
                take = min(len(rows) - 1, left)  # keep the last position for the drafting forward
                if take <= 0:
                    continue
                chunks.append(self._chunk(plan[i], v, v + take))
                inputs.append(rows[:take])
                history[i] = (v + take, rows[take:])
                left -= take
                if left == 0:
                    break
            if not chunks:
                break
            self._run(chunks, inputs)
        return history

    def _run(self, chunks: list[Chunk], hidden: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of each chunk's last position ``[R, V]`` and the MTP's output state there ``[R, H]``."""
        shared, per_rank = build_step_inputs(chunks, self.mesh, self.block_size, self.interleave)
        last = shared["cu_seqlens_q"][1:].to(torch.int64) - 1
        rows = torch.cat(hidden)
        key, name = "mixed", "mixed"
        bucket = self.buckets.bucket_for(len(chunks)) if self.buckets is not None else None
        if bucket is not None and all(len(c.tokens) == 1 for c in chunks):
            # graph mode as the target's decode: padding rows get a zero hidden state (hnorm(0) = 0)
            shared, per_rank = self.buckets.pad(shared, per_rank, bucket, self.mesh)
            rows = torch.cat([rows, rows.new_zeros(bucket - len(chunks), rows.shape[1])])
            key, name = ("decode", bucket), f"decode[{bucket}]"
        shared["hidden_states"] = rows.unsqueeze(0)
        logits = self.executor.run(shared, per_rank, key)[: len(chunks)]
        self.steps += 1
        self.graph_steps[name] = self.graph_steps.get(name, 0) + 1
        return logits, self.executor.last_hidden[last]
