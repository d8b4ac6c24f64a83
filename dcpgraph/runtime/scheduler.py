"""Continuous batching with a chunked-prefill token budget.

A request's tokens are ``prompt + output``; the first ``computed`` of them are in the KV cache.
Each step gives every running request its next chunk ``tokens[computed : computed + n]`` within
a shared token budget: decode rows (one pending token) first, then prefill chunks in admission
order, then newly admitted requests. A request is sampled when its chunk reaches its last known
token, so prefill and decode are the same thing at different chunk sizes. Admission reserves the
request's whole block budget (see :class:`~dcpgraph.runtime.blocks.BlockManager`).

With prefix caching on, admission first matches the prompt against the cache of full virtual
blocks: a request whose first ``h`` blocks hit starts with ``computed = h · block_size · dcp`` and a
block table beginning with the shared block ids, and the step computes only the rest (at least the
last prompt token). The hit is valid on every DCP rank at once because the hash covers whole virtual
blocks and the table is shared by the group; the slot mapping of the recomputed tokens is the usual
``layout.slot_mapping(positions, table)`` and lands in the request's own blocks only (asserted in
:meth:`Scheduler._chunk`). After each step :meth:`Scheduler.advance` moves ``computed`` on and
registers the blocks that became full.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from .blocks import BlockManager
from .sampling import SamplingParams
from .step_inputs import Chunk


@dataclass
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    computed: int = 0
    finished: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def reserve_tokens(self) -> int:
        return len(self.prompt) + self.max_new_tokens


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    chunk: Chunk
    samples: bool


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batched_tokens: int, max_num_seqs: int):
        if max_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_batched_tokens and max_num_seqs must be >= 1")
        self.blocks = blocks
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prompt_tokens_computed = 0  # prompt tokens the engine actually ran (prefix hits excluded)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_batched_tokens
        plan: list[ScheduledChunk] = []
        ordered = sorted(self.running, key=lambda r: len(r.tokens) - r.computed > 1)  # decodes first
        for request in ordered:
            if budget == 0:
                break
            budget -= self._chunk(request, budget, plan)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            prefix = self.blocks.match_prefix(request.prompt)
            if not self.blocks.can_reserve(request.reserve_tokens, prefix):
                break
            self.waiting.popleft()
            self.blocks.reserve(request.id, request.reserve_tokens, prefix)
            if self.blocks.enable_prefix_caching:
                self.blocks.record_query(len(request.prompt), len(prefix))
            if prefix:  # a fresh request starts at 0; a hit skips its cached blocks
                request.computed = len(prefix) * self.blocks.tokens_per_block
            assert request.computed < len(request.prompt)
            self.running.append(request)
            budget -= self._chunk(request, budget, plan)
        return plan

    def advance(self, request: Request, n: int) -> None:
        """``n`` more tokens of ``request`` are in the KV cache on every rank; register the
        virtual blocks that became full (prefix caching)."""
        request.computed += n
        if self.blocks.enable_prefix_caching:
            self.blocks.register(request.id, request.tokens, request.computed)

    def _chunk(self, request: Request, budget: int, plan: list[ScheduledChunk]) -> int:
        tokens = request.tokens
        n = min(len(tokens) - request.computed, budget)
        if n <= 0:
            return 0
        start = request.computed
        self.blocks.check_writable(request.id, start, start + n)  # never into a shared/hashed block
        self.prompt_tokens_computed += max(0, min(start + n, len(request.prompt)) - start)
        chunk = Chunk(request.id, tuple(tokens[start : start + n]), start, tuple(self.blocks.table(request.id)))
        plan.append(ScheduledChunk(request, chunk, samples=start + n == len(tokens)))
        return n

    def finish(self, request: Request) -> None:
        request.finished = True
        self.running.remove(request)
        self.blocks.release(request.id)
