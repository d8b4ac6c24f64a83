"""Continuous batching with a chunked-prefill token budget.

A request's tokens are ``prompt + output``; the first ``computed`` of them are in the KV cache.
Each step gives every running request its next chunk ``tokens[computed : computed + n]`` within
a shared token budget: decode rows (one pending token) first, then prefill chunks in admission
order, then newly admitted requests. A request is sampled when its chunk reaches its last known
token, so prefill and decode are the same thing at different chunk sizes.

KV blocks are allocated on demand (:class:`~dcpgraph.runtime.blocks.BlockManager`): admission
takes the blocks of a request's first chunk, and before every step a running request's table is
grown to hold the step's tokens (plus room for its drafts, only if free blocks allow). When a
table cannot grow, the *youngest* running request (last admitted) is preempted: its blocks are
released, ``computed`` drops to 0 and it goes back to the front of the waiting queue with its
output so far; re-admitted, it recomputes ``prompt + output`` (its own full blocks may still be in
the prefix cache) and samples its next token only when the recomputation reaches its last token,
with its generator untouched, so its tokens are exactly those of an uninterrupted run. The oldest
running request can always grow (every request fits the whole cache, checked at ``add``), so the
schedule always makes progress. No request is admitted in a step that preempted one. With
``kv_allocation="whole_request"`` admission instead takes ``prompt + max_new_tokens`` at once and
nothing is ever preempted (the baseline ``benchmarks/kv_preemption.py`` measures against).

New requests wait in a queue bounded by ``max_waiting`` (:class:`QueueFullError` past it);
preempted requests always re-enter it.

After the model ran, :meth:`Scheduler.postprocess` owns everything that follows: speculative
acceptance, appending tokens, the stop conditions (``max_new_tokens``, or an EOS id unless the
request has ``ignore_eos`` or has not reached its ``min_tokens``), moving
``computed`` on and finishing. A finished or aborted request leaves the scheduler at once (its
blocks are released and nothing here refers to it any more), so the scheduler holds exactly the
live requests.

With prefix caching on, admission first matches the request's tokens (the prompt, or after a
preemption prompt + output) against the cache of full virtual blocks: a request whose first ``h`` blocks hit starts with ``computed = h · block_size · dcp`` and a
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

from ..errors import QueueFullError, RequestError
from .acceptance import AcceptanceStats
from .blocks import BlockManager, block_hashes
from .rejection import accept
from .requests import Request, RowOutput, ScheduledChunk, StepEvent
from .state_slots import StateSlots
from .step_inputs import Chunk


class Scheduler:
    created = 0  # schedulers made in this process (a worker group's processes report theirs)

    def __init__(self, blocks: BlockManager, max_batched_tokens: int, max_num_seqs: int, *,
                 eos_token_ids: Iterable[int] = (), speculative_tokens: int = 0,
                 max_waiting: int | None = None, kv_allocation: str = "on_demand", state_slots: int = 0):
        Scheduler.created += 1
        if max_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_batched_tokens and max_num_seqs must be >= 1")
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1 (or None: unbounded), got {max_waiting}")
        if kv_allocation not in ("on_demand", "whole_request"):
            raise ValueError(f"kv_allocation must be 'on_demand' or 'whole_request', got {kv_allocation!r}")
        if state_slots and state_slots < max_num_seqs:
            raise ValueError(f"state_slots ({state_slots}) must cover max_num_seqs ({max_num_seqs}) running requests")
        self.max_waiting = max_waiting
        self.state_slots = StateSlots(state_slots)  # recurrent-state rows (hybrid models), one per running request
        self.state_prefix = None  # a StatePrefixCache when a hybrid runs with prefix caching
        self.whole_request = kv_allocation == "whole_request"
        self.blocks = blocks
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.speculative_tokens = speculative_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._live: dict[int, Request] = {}
        self.prompt_tokens_computed = 0  # prompt tokens the engine actually ran (prefix hits excluded)
        self.acceptance = AcceptanceStats(speculative_tokens)
        # preempted_tokens: cached tokens discarded by preemption (recomputed on re-admission)
        self.stats = {"preemptions": 0, "preempted_tokens": 0, "peak_running": 0}

    # -- the requests it holds ---------------------------------------------------------------------
    def can_add(self) -> bool:
        """Whether :meth:`add` would accept a request now (the waiting queue has room)."""
        return self.max_waiting is None or len(self.waiting) < self.max_waiting

    def add(self, request: Request) -> None:
        """Queue ``request`` for admission (in arrival order); ``QueueFullError`` if the waiting
        queue already holds ``max_waiting`` requests."""
        if not self.can_add():
            raise QueueFullError(f"{len(self.waiting)} requests are waiting (max_waiting={self.max_waiting}); "
                                 "retry after some finish")
        self._hold(request)
        self.waiting.append(request)

    def adopt(self, request: Request, prefix: Sequence[int] = ()) -> None:
        """Run ``request`` from its current ``computed``/``output`` (its KV is written by the caller
        into :meth:`BlockManager.table` before the next step), bypassing the waiting queue but not
        the limits: raises ``RequestError`` if no sequence slot or not enough blocks are free now.
        ``prefix``: cached blocks (:meth:`BlockManager.match_prefix`) its table starts with."""
        if len(self.running) >= self.max_num_seqs:
            raise RequestError(f"no free sequence slot: max_num_seqs={self.max_num_seqs} requests are running")
        if not self.state_slots.available():
            raise RequestError(f"no free recurrent-state slot: {self.state_slots.held_count} of {self.state_slots.count} "
                               "are kept by prefilled requests waiting for their transfer")
        tokens = request.reserve_tokens if self.whole_request else len(request.tokens)
        if not self.blocks.can_allocate(tokens, prefix):
            raise RequestError(f"not enough free KV blocks to take over a request of {tokens} tokens now "
                               f"({self.blocks.free_blocks} of {self.blocks.num_blocks} blocks free)")
        self._hold(request)
        self.blocks.allocate(request.id, tokens, prefix)
        if self.blocks.enable_prefix_caching:
            self.blocks.record_query(len(request.prompt), len(prefix))
        self._run(request)

    def detach(self, request_id: int) -> Request:
        """Stop scheduling running request ``request_id`` but keep its KV blocks (under its id,
        until the caller's ``blocks.release``) and its recurrent-state slot (until
        :meth:`release_state_slot`): a prefilled request handed to another engine. A kept slot is
        not free for admission, so nothing overwrites the state before it is sent."""
        request = self._live.get(request_id)
        if request is None or request not in self.running:
            raise RequestError(f"request {request_id} is not running")
        self.running.remove(request)
        if request.state_slot is not None:
            self.state_slots.hold(request.id, request.state_slot)
        self._drop(request)
        return request

    def held_state_slot(self, request_id: int) -> int | None:
        """The state slot a detached request keeps (``None``: none kept, or no recurrent layers)."""
        return self.state_slots.held(request_id)

    def release_state_slot(self, request_id: int) -> bool:
        """Give back the state slot :meth:`detach` kept for ``request_id``; ``False`` if none."""
        return self.state_slots.release(request_id)

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
        plan: list[ScheduledChunk] = []
        preemptions = self.stats["preemptions"]
        for request in sorted(self.running, key=lambda r: r.num_tokens - r.computed > 1):  # decodes first
            budget = self._budget(plan)
            if budget == 0:
                break
            if request not in self.running:  # preempted for an older request earlier in this loop
                continue
            n = min(request.num_tokens - request.computed, budget)
            if n <= 0:
                continue
            end = request.computed + n
            room = self._draft_room(request, n, end == request.num_tokens)
            room = max(0, min(room, self.blocks.room(request.id) - end))  # drafts never preempt anyone
            if self._fit(request, end + room, plan):
                self._chunk(request, n, plan)
        while (self.waiting and len(self.running) < self.max_num_seqs and self.state_slots.available()
               and self.stats["preemptions"] == preemptions):
            budget = self._budget(plan)
            if budget == 0 or not self._admit(self.waiting[0], budget, plan):
                break
        return plan

    def _budget(self, plan: list[ScheduledChunk]) -> int:
        return self.max_batched_tokens - sum(len(item.chunk.tokens) for item in plan)

    def _admit(self, request: Request, budget: int, plan: list[ScheduledChunk]) -> bool:
        """Start (or restart, after a preemption) the head of the waiting queue with its first chunk,
        if its blocks fit without preempting anyone."""
        tokens = request.tokens
        # vLLM's rule: a request still owing prompt log-probabilities reads no cached prefix (the
        # cached positions' logits were never kept), so it runs its whole prompt
        prefix = [] if request.needs_prompt_logprobs else self.blocks.match_prefix(tokens)
        state_hash = None
        if prefix and self.state_prefix is not None:  # only as far as a recurrent state was kept
            prefix, state_hash = self._prefix_with_state(tokens, prefix)
        start = len(prefix) * self.blocks.tokens_per_block if prefix else request.computed
        n = min(len(tokens) - start, budget)
        need = request.reserve_tokens if self.whole_request else start + n
        if not self.blocks.can_allocate(need, prefix):
            return False
        self.waiting.popleft()
        self.blocks.allocate(request.id, need, prefix)
        if self.blocks.enable_prefix_caching:  # every admission looks up, re-admissions included
            self.blocks.record_query(len(tokens), len(prefix), preempted=request.preemptions > 0)
        request.computed = start  # a fresh request starts at 0; a hit skips its cached blocks
        assert request.computed < len(tokens)
        self._run(request)
        if state_hash is not None:
            self.state_prefix.restore(state_hash, request.state_slot)
        self._chunk(request, n, plan)
        return True

    def _prefix_with_state(self, tokens: Sequence[int], prefix: list[int]) -> tuple[list[int], bytes | None]:
        """``prefix`` cut to its longest head whose last block has a kept recurrent state, and
        that block's hash (``None``: no head has one, so no hit)."""
        hashes = block_hashes(tokens, self.blocks.tokens_per_block, limit=len(prefix))
        for n in range(len(prefix), 0, -1):
            if self.state_prefix.lookup(hashes[n - 1]) is not None:
                return prefix[:n], hashes[n - 1]
        return [], None

    def take_state_copies(self) -> list[tuple[int, int]]:
        """State-row copies the next step carries (:mod:`.state_prefix_cache`)."""
        return self.state_prefix.take_copies() if self.state_prefix is not None else []

    def _run(self, request: Request) -> None:
        request.state_slot = self.state_slots.take()
        self.running.append(request)
        self.stats["peak_running"] = max(self.stats["peak_running"], len(self.running))

    def _fit(self, request: Request, tokens: int, plan: list[ScheduledChunk]) -> bool:
        """Grow ``request``'s table to ``tokens`` tokens, preempting the youngest running requests
        until it fits; ``False`` if ``request`` itself was the youngest and got preempted."""
        while not self.blocks.grow(request.id, tokens):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, plan: list[ScheduledChunk]) -> None:
        """Free ``request``'s blocks and queue it first for recomputation; it keeps its output."""
        plan[:] = [item for item in plan if item.request is not request]
        self.running.remove(request)
        self._stop_running(request)
        self.blocks.release(request.id)
        self.stats["preemptions"] += 1
        self.stats["preempted_tokens"] += request.computed
        request.computed = 0
        request.preemptions += 1
        self.waiting.appendleft(request)

    def _chunk(self, request: Request, n: int, plan: list[ScheduledChunk]) -> None:
        tokens, start = request.tokens, request.computed
        self.blocks.check_writable(request.id, start, start + n)  # never into a shared/hashed block
        table = self.blocks.frozen_table(request.id)
        rows = n if request.needs_prompt_logprobs else 1  # every position's logits, or the last one's
        chunk = Chunk(request.id, tuple(tokens[start : start + n]), start, table, logits_rows=rows,
                      sliding_table=self.blocks.frozen_group_table(request.id), state_slot=request.state_slot)
        samples = start + n == len(tokens)
        room = min(self._draft_room(request, n, samples), len(table) * self.blocks.tokens_per_block - start - n)
        plan.append(ScheduledChunk(request, chunk, samples, room))

    def _draft_room(self, request: Request, n: int, samples: bool) -> int:
        """Drafts a chunk may carry: never past ``max_new_tokens`` (nor, in :meth:`_chunk`, the table)."""
        if not (self.speculative_tokens and samples and n == 1 and request.speculative):
            return 0
        return max(0, min(self.speculative_tokens, request.max_new_tokens - len(request.output) - 1))

    def postprocess(self, plan: Sequence[ScheduledChunk], outputs: Sequence[RowOutput]) -> list[StepEvent]:
        """Apply one step's results: accept drafts, append tokens until a stop condition, move
        ``computed`` on (tokens first: prefix-cache registration hashes them), finish requests."""
        events: list[StepEvent] = []
        for item, out in zip(plan, outputs, strict=True):
            request = item.request
            emitted, advance = self._accepted(item, out)
            if out.prompt_logprobs:
                request.prompt_logprobs.extend(out.prompt_logprobs)
            done = False
            for n, token in enumerate(emitted):
                request.output.append(token)
                done = len(request.output) >= request.max_new_tokens or self._stops_at(request, token)
                first = request.prompt_logprobs if len(request.output) == 1 else None
                events.append(StepEvent(request.id, token, done, out.logprobs[n] if out.logprobs else None, first))
                if done:  # tokens past the stop (confirmed drafts) are not kept
                    advance = min(advance, len(item.chunk.tokens) + n)
                    break
            self._advance(request, advance)
            if done:
                self._finish(request)
        return events

    def _stops_at(self, request: Request, token: int) -> bool:
        """Whether ``token`` (just appended) ends ``request`` before its budget: an EOS id, unless
        the request has ``ignore_eos`` or fewer than ``min_tokens`` tokens are out (vLLM's
        ``check_stop``; ``min_tokens`` also masks EOS while sampling, so this only guards)."""
        params = request.params
        return (token in self.eos_token_ids and not params.ignore_eos
                and len(request.output) >= params.min_tokens)

    @property
    def spec_stats(self) -> dict:
        """``{"drafted", "accepted"}`` so far (the full record: :attr:`acceptance`)."""
        return {"drafted": self.acceptance.drafted, "accepted": self.acceptance.accepted}

    def _accepted(self, item: ScheduledChunk, out: RowOutput) -> tuple[list[int], int]:
        """Tokens to emit, and how many of the step's tokens are now validly cached."""
        if not out.drafts:
            return list(out.tokens), len(item.chunk.tokens)
        accepted = accept(out.drafts, out.tokens)
        self.acceptance.record(len(out.drafts), accepted)
        return list(out.tokens[: accepted + 1]), 1 + accepted  # the last token + confirmed drafts

    def _advance(self, request: Request, n: int) -> None:
        """``n`` more tokens of ``request`` are in the KV cache on every rank; register the
        virtual blocks that became full (prefix caching)."""
        start, prompt = request.computed, len(request.prompt)
        self.prompt_tokens_computed += max(0, min(start + n, prompt) - start)
        request.computed += n
        self.blocks.trim(request.id, request.computed)
        if self.blocks.enable_prefix_caching:
            self.blocks.register(request.id, request.tokens, request.computed)
        per_block = self.blocks.tokens_per_block
        if self.state_prefix is not None and request.state_slot is not None and n and request.computed % per_block == 0:
            full = request.computed // per_block
            last = self.blocks.registered_hash(request.id, full)  # register just hashed it; else hash the chain
            if last is None:
                last = block_hashes(request.tokens[: request.computed], per_block)[-1]
            self.state_prefix.save(last, request.state_slot)

    def _finish(self, request: Request) -> None:
        self.running.remove(request)
        self._stop_running(request)
        self.blocks.release(request.id)
        self._drop(request)

    def _stop_running(self, request: Request) -> None:
        """Give back ``request``'s recurrent-state slot (a later run restarts its state at 0)."""
        if request.state_slot is not None:
            self.state_slots.give_back(request.state_slot)
            request.state_slot = None

    def _drop(self, request: Request) -> None:
        request.finished = True
        del self._live[request.id]
