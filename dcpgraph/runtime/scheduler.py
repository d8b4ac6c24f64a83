"""Continuous batching with a chunked-prefill token budget.

A request's tokens are ``prompt + output``; the first ``computed`` of them are in the KV cache.
Each step gives every running request its next chunk ``tokens[computed : computed + n]`` within
a shared token budget: decode rows (one pending token) first, then prefill chunks in admission
order, then newly admitted requests. A request is sampled when its chunk reaches its last known
token, so prefill and decode are the same thing at different chunk sizes. Admission reserves the
request's whole block budget (see :class:`~dcpgraph.runtime.blocks.BlockManager`).

After the model ran, :meth:`Scheduler.postprocess` owns everything that follows: speculative
acceptance, appending tokens, the stop conditions (``max_new_tokens`` or an EOS id), moving
``computed`` on and finishing. A finished or aborted request leaves the scheduler at once (its
blocks are released and nothing here refers to it any more), so the scheduler holds exactly the
live requests.

With prefix caching on, admission first matches the prompt against the cache of full virtual
blocks: a request whose first ``h`` blocks hit starts with ``computed = h · block_size · dcp`` and a
block table beginning with the shared block ids, and the step computes only the rest (at least the
last prompt token). The hit is valid on every DCP rank at once because the hash covers whole virtual
blocks and the table is shared by the group; the slot mapping of the recomputed tokens is the usual
``layout.slot_mapping(positions, table)`` and lands in the request's own blocks only (asserted in
:meth:`Scheduler._chunk`). After each step ``computed`` moves on and the blocks that became full
are registered.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..errors import RequestError
from .blocks import BlockManager
from .sampling import SamplingParams
from .speculative import accept
from .step_inputs import Chunk


@dataclass(eq=False)
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    computed: int = 0
    finished: bool = False
    speculative: bool = True  # whether its greedy decode rows may carry prompt-lookup drafts

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def reserve_tokens(self) -> int:
        return len(self.prompt) + self.max_new_tokens


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step. ``draft_room``: how many draft tokens may follow the chunk
    (its blocks hold them and the request has that many tokens left to emit); 0 unless the chunk
    is one token that is sampled greedily and speculation is on."""

    request: Request
    chunk: Chunk
    samples: bool
    draft_room: int = 0


class StepEvent(NamedTuple):
    """One emitted token. ``finished``: the request ended with it (it is then no longer held)."""

    request_id: int
    token: int
    finished: bool


class RowOutput(NamedTuple):
    """What the model runner produced for one :class:`ScheduledChunk`: ``tokens`` sampled (none
    for a prefill chunk that does not reach the last token; with drafts, the target's greedy token
    after each of the ``1 + len(drafts)`` query rows) and the ``drafts`` it verified."""

    tokens: list[int]
    drafts: list[int]


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batched_tokens: int, max_num_seqs: int, *,
                 eos_token_ids: Iterable[int] = (), speculative_tokens: int = 0):
        if max_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_batched_tokens and max_num_seqs must be >= 1")
        self.blocks = blocks
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.speculative_tokens = speculative_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._live: dict[int, Request] = {}
        self.prompt_tokens_computed = 0  # prompt tokens the engine actually ran (prefix hits excluded)
        self.spec_stats = {"drafted": 0, "accepted": 0}

    # -- the requests it holds ---------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue ``request`` for admission (in arrival order)."""
        self._hold(request)
        self.waiting.append(request)

    def adopt(self, request: Request) -> None:
        """Run ``request`` from its current ``computed``/``output`` (its KV is written by the caller
        into :meth:`BlockManager.table` before the next step), bypassing the waiting queue but not
        the limits: raises ``RequestError`` if no sequence slot or not enough blocks are free now."""
        if len(self.running) >= self.max_num_seqs:
            raise RequestError(f"no free sequence slot: max_num_seqs={self.max_num_seqs} requests are running")
        if not self.blocks.can_reserve(request.reserve_tokens):
            raise RequestError(f"not enough free KV blocks to take over a request of {request.reserve_tokens} "
                               f"tokens now ({self.blocks.free_blocks} of {self.blocks.num_blocks} blocks free)")
        self._hold(request)
        self.blocks.reserve(request.id, request.reserve_tokens)
        self.running.append(request)

    def get(self, request_id: int) -> Request | None:
        """The live (waiting or running) request with this id; ``None`` once it ended."""
        return self._live.get(request_id)

    @property
    def live(self) -> int:
        """Requests held: waiting + running."""
        return len(self._live)

    def has_work(self) -> bool:
        return bool(self._live)

    def abort(self, request_id: int) -> bool:
        """End a live request now: its blocks are released and it is never scheduled again.
        Returns ``False`` (and changes nothing) for an id that is not live."""
        request = self._live.get(request_id)
        if request is None:
            return False
        if request in self.running:
            self._finish(request)
        else:
            self.waiting.remove(request)
            self._drop(request)
        return True

    def _hold(self, request: Request) -> None:
        if request.id in self._live:
            raise ValueError(f"request {request.id} is already held")
        self._live[request.id] = request

    # -- one step ------------------------------------------------------------------------------
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

    def _chunk(self, request: Request, budget: int, plan: list[ScheduledChunk]) -> int:
        tokens = request.tokens
        n = min(len(tokens) - request.computed, budget)
        if n <= 0:
            return 0
        start = request.computed
        self.blocks.check_writable(request.id, start, start + n)  # never into a shared/hashed block
        chunk = Chunk(request.id, tuple(tokens[start : start + n]), start, tuple(self.blocks.table(request.id)))
        samples = start + n == len(tokens)
        plan.append(ScheduledChunk(request, chunk, samples, self._draft_room(request, n, samples)))
        return n

    def _draft_room(self, request: Request, n: int, samples: bool) -> int:
        if not (self.speculative_tokens and samples and n == 1 and request.speculative and request.params.greedy):
            return 0
        # the drafts' KV lands at positions before prompt + max_new_tokens - 1: inside the reservation
        return max(0, min(self.speculative_tokens, request.max_new_tokens - len(request.output) - 1))

    def postprocess(self, plan: Sequence[ScheduledChunk], outputs: Sequence[RowOutput]) -> list[StepEvent]:
        """Apply one step's results: accept drafts, append tokens until a stop condition, move
        ``computed`` on (tokens first: prefix-cache registration hashes them), finish requests."""
        events: list[StepEvent] = []
        for item, out in zip(plan, outputs, strict=True):
            request = item.request
            emitted, advance = self._accepted(item, out)
            done = False
            for n, token in enumerate(emitted):
                request.output.append(token)
                done = len(request.output) >= request.max_new_tokens or token in self.eos_token_ids
                events.append(StepEvent(request.id, token, done))
                if done:  # tokens past the stop (confirmed drafts) are not kept
                    advance = min(advance, len(item.chunk.tokens) + n)
                    break
            self._advance(request, advance)
            if done:
                self._finish(request)
        return events

    def _accepted(self, item: ScheduledChunk, out: RowOutput) -> tuple[list[int], int]:
        """Tokens to emit, and how many of the step's tokens are now validly cached."""
        if not out.drafts:
            return list(out.tokens), len(item.chunk.tokens)
        accepted = accept(out.drafts, out.tokens)
        self.spec_stats["drafted"] += len(out.drafts)
        self.spec_stats["accepted"] += accepted
        return list(out.tokens[: accepted + 1]), 1 + accepted  # the last token + confirmed drafts

    def _advance(self, request: Request, n: int) -> None:
        """``n`` more tokens of ``request`` are in the KV cache on every rank; register the
        virtual blocks that became full (prefix caching)."""
        start, prompt = request.computed, len(request.prompt)
        self.prompt_tokens_computed += max(0, min(start + n, prompt) - start)
        request.computed += n
        if self.blocks.enable_prefix_caching:
            self.blocks.register(request.id, request.tokens, request.computed)

    def _finish(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.release(request.id)
        self._drop(request)

    def _drop(self, request: Request) -> None:
        request.finished = True
        del self._live[request.id]
