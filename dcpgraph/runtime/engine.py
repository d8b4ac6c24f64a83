"""``Engine``: serves generation requests with a compiled per-rank program.

Requests are validated completely before any rank does any work: a request that can never be
served raises :class:`~dcpgraph.errors.RequestError` and leaves the engine, and every request
already running, untouched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from ..errors import RequestError
from ..program import Program
from .blocks import BlockManager
from .graph_mode import DecodeBuckets, default_buckets
from .sampling import SamplingParams, sample
from .scheduler import Request, Scheduler
from .speculative import accept, propose
from .step_inputs import build_step_inputs


def kv_bytes_per_block(program: Program) -> int:
    """Bytes of one physical block (``block_size`` tokens) of every cache on one rank."""
    from ..capacity import bytes_per_block, cache_shapes  # one formula, shared with the planner

    return bytes_per_block(cache_shapes(program.caches), int(program.options["block_size"]))


class Engine:
    def __init__(
        self,
        program: Program,
        *,
        executor_cls,
        num_blocks: int,
        max_model_len: int,
        max_batched_tokens: int,
        max_num_seqs: int,
        graphs=None,
        capture_limit: int = 32,
        speculative_tokens: int = 0,
        enable_prefix_caching: bool = False,
    ):
        self.program = program
        self.mesh = program.mesh
        self.block_size = int(program.options["block_size"])
        self.interleave = int(program.options.get("interleave", 1))
        self.max_model_len = max_model_len
        self.blocks = BlockManager(num_blocks, self.block_size * self.mesh.dcp, enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_batched_tokens, max_num_seqs)
        self.executor = executor_cls(program, num_blocks, graphs)
        self.graphs = graphs
        self.buckets = None
        if capture_limit > 0:
            width = math.ceil(max_model_len / (self.block_size * self.mesh.dcp))
            self.buckets = DecodeBuckets(default_buckets(min(capture_limit, max_num_seqs)), width)
        self._next_id = 0
        self._requests: dict[int, Request] = {}
        self.steps = 0
        self.graph_steps: dict[str, int] = {}
        self.speculative_tokens = speculative_tokens
        self.spec_stats = {"drafted": 0, "accepted": 0}

    # -- requests -----------------------------------------------------------------------------
    def check_request(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        facts = self.program.facts
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        tokens = [int(t) for t in prompt] if prompt is not None else []
        if not tokens:
            raise RequestError("empty prompt: at least one token is needed")
        bad = [t for t in tokens if not 0 <= t < facts.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {facts.vocab_size})")
        total = len(tokens) + max_new_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({len(tokens)}) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
                f"max_model_len={self.max_model_len}"
            )
        if self.blocks.blocks_for(total) > self.blocks.num_blocks:
            raise RequestError(
                f"{total} tokens need {self.blocks.blocks_for(total)} KV blocks; the cache has "
                f"{self.blocks.num_blocks} ({self.blocks.capacity_tokens} tokens)"
            )
        return tokens

    def add_request(self, prompt: Sequence[int], max_new_tokens: int, **sampling: Any) -> int:
        """Queue one request; returns its id. Raises ``RequestError`` before queuing anything."""
        tokens = self.check_request(prompt, max_new_tokens)
        params = SamplingParams(**sampling)
        return self._enqueue(tokens, max_new_tokens, params)

    def _enqueue(self, tokens: list[int], max_new_tokens: int, params: SamplingParams, index: int = 0) -> int:
        rid = self._next_id
        self._next_id += 1
        gen = None
        if not params.greedy:
            # A seeded request's stream depends on its seed and its index in its generate() call,
            # not on how many requests this engine served before (so the same seed reproduces the
            # same tokens on the same engine); unseeded requests get one stream per request id.
            gen = torch.Generator().manual_seed(rid if params.seed is None else params.seed + index)
        request = Request(rid, tokens, max_new_tokens, params, gen)
        self._requests[rid] = request
        self.scheduler.add(request)
        return rid

    def step(self) -> list[tuple[int, int, bool]]:
        """Run one scheduled step on every rank; returns ``(request_id, token, finished)``."""
        plan = self.scheduler.schedule()
        if not plan:
            if self.scheduler.has_work():
                raise RuntimeError("scheduler made no progress (cache too small for any waiting request)")
            return []
        drafts = {i: self._drafts(p) for i, p in enumerate(plan)}
        chunks = [
            replace(p.chunk, tokens=p.chunk.tokens + tuple(drafts[i]), logits_rows=1 + len(drafts[i]))
            if drafts[i] else p.chunk
            for i, p in enumerate(plan)
        ]
        shared, per_rank = build_step_inputs(chunks, self.mesh, self.block_size, self.interleave)
        key = "mixed"
        bucket = None
        if self.buckets is not None and all(len(c.tokens) == 1 for c in chunks):
            bucket = self.buckets.bucket_for(len(plan))
        if bucket is not None:
            shared, per_rank = self.buckets.pad(shared, per_rank, bucket, self.mesh)
            key = ("decode", bucket)
        name = key if isinstance(key, str) else f"decode[{bucket}]"
        self.graph_steps[name] = self.graph_steps.get(name, 0) + 1
        logits = self.executor.run(shared, per_rank, key)
        self.steps += 1
        events = []
        eos = set(self.program.facts.eos_token_id)
        row = 0
        for i, item in enumerate(plan):
            request, chunk = item.request, chunks[i]
            rows = logits[row : row + chunk.logits_rows]
            row += chunk.logits_rows
            if drafts[i]:
                greedy = [int(r.argmax()) for r in rows]
                accepted = accept(drafts[i], greedy)
                self.spec_stats["drafted"] += len(drafts[i])
                self.spec_stats["accepted"] += accepted
                emitted, advance = greedy[: accepted + 1], 1 + accepted  # last token + confirmed drafts
            else:
                emitted, advance = None, len(chunk.tokens)
                if item.samples:
                    emitted = [sample(rows[-1], request.params, request.generator)]
            done = False
            for n, token in enumerate(emitted or ()):
                request.output.append(token)
                done = len(request.output) >= request.max_new_tokens or token in eos
                events.append((request.id, token, done))
                if done:
                    if drafts[i]:
                        advance = min(advance, n + 1)  # confirmed drafts past the stop are not kept
                    break
            # Tokens first, then ``computed``: blocks are registered for prefix caching from both.
            self.scheduler.advance(request, advance)
            if done:
                self.scheduler.finish(request)
        return events

    def _drafts(self, item) -> list[int]:
        """Prompt-lookup drafts for a greedy decode row (never past the request's budget)."""
        request = item.request
        if not (self.speculative_tokens and item.samples and len(item.chunk.tokens) == 1 and request.params.greedy):
            return []
        room = request.max_new_tokens - len(request.output) - 1
        return propose(request.tokens, min(self.speculative_tokens, room))

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, **sampling: Any) -> list[list[int]]:
        """New tokens of each prompt (greedy unless ``temperature`` > 0). All prompts are checked
        before any work starts; a bad one raises ``RequestError`` naming it."""
        params = SamplingParams(**sampling)
        checked = []
        for i, prompt in enumerate(prompts):
            try:
                checked.append(self.check_request(prompt, max_new_tokens))
            except RequestError as err:
                raise RequestError(f"prompt {i}: {err}") from None
        ids = [self._enqueue(tokens, max_new_tokens, params, i) for i, tokens in enumerate(checked)]
        while not all(self._requests[i].finished for i in ids):
            self.step()
        return [self._requests.pop(i).output for i in ids]

    # -- prefill/decode disaggregation -------------------------------------------------------
    def prefill(self, prompt: Sequence[int], **sampling: Any):
        """Run ``prompt`` until its first token is sampled and export its KV
        (:class:`~dcpgraph.runtime.kv_transfer.KVTransfer`); the request then leaves this engine."""
        from .kv_transfer import export_kv

        rid = self.add_request(prompt, 2, **sampling)
        request = self._requests[rid]
        while not request.output:
            self.step()
        transfer = export_kv(self, request)
        self.scheduler.finish(request)
        del self._requests[rid]
        return transfer

    def continue_from(self, transfer, max_new_tokens: int, **sampling: Any) -> int:
        """Continue a request exported by another engine's :meth:`prefill` (same model and tp,
        any dcp / interleave / block size): re-shards its KV into this engine's cache and queues
        it for decoding. ``max_new_tokens`` counts the token the prefill engine sampled."""
        from .kv_transfer import check_transfer, import_kv

        check_transfer(self, transfer)
        prompt = list(transfer.tokens[: transfer.prompt_len])
        self.check_request(prompt, max_new_tokens)
        if not self.blocks.can_reserve(len(prompt) + max_new_tokens):
            raise RequestError("not enough free KV blocks to take over the request now")
        rid = self._enqueue(prompt, max_new_tokens, SamplingParams(**sampling))
        request = self._requests[rid]
        self.scheduler.waiting.remove(request)
        self.blocks.reserve(rid, request.reserve_tokens)
        request.output = list(transfer.tokens[transfer.prompt_len :])
        request.computed = transfer.computed
        import_kv(self, transfer, request)
        self.scheduler.running.append(request)
        return rid

    # -- reports ------------------------------------------------------------------------------
    def memory_report(self) -> dict:
        per_block = kv_bytes_per_block(self.program)
        per_rank = per_block * self.blocks.num_blocks
        capacity = self.blocks.capacity_tokens
        return {
            "kv_bytes_per_rank": [per_rank for _ in self.mesh.ranks],
            "kv_bytes_per_token": per_rank / capacity,
            "kv_capacity_tokens": capacity,
            "num_blocks": self.blocks.num_blocks,
            "block_size": self.block_size,
            "virtual_block_tokens": self.block_size * self.mesh.dcp,
            "tp": self.mesh.tp,
            "dcp": self.mesh.dcp,
            "prefix_cache": self.prefix_cache_report(),
            "weight_bytes_per_rank": _weight_bytes_per_rank(self.program),
        }

    def prefix_cache_report(self) -> dict:
        """Prefix-cache counters: ``queries`` (admitted requests looked up) and ``query_tokens``
        (their prompt tokens), ``hit_requests``/``hit_tokens`` (requests with a hit, prompt tokens
        served from the cache), ``evictions``, ``cached_blocks`` (virtual blocks holding a hash,
        in use or free) and ``prompt_tokens_computed`` (prompt tokens the ranks actually ran).
        A hit is one virtual block on every DCP rank at once."""
        return {
            "enabled": self.blocks.enable_prefix_caching,
            **self.blocks.stats,
            "cached_blocks": self.blocks.cached_blocks,
            "prompt_tokens_computed": self.scheduler.prompt_tokens_computed,
        }

    def report(self) -> dict:
        """What ran where: per graph, the backend used and any fallback with its reason, the
        decode buckets, and how many steps each graph served."""
        backend = self.graphs.report() if self.graphs is not None else {"backend": "eager", "graphs": {}}
        return {
            "executor": self.executor.mode,
            "mesh": str(self.mesh),
            "comm": self.program.options.get("comm"),
            "steps": self.steps,
            "graph_steps": dict(self.graph_steps),
            "decode_buckets": list(self.buckets.sizes) if self.buckets else [],
            "speculative": {"tokens": self.speculative_tokens, **self.spec_stats},
            "prefix_cache": self.prefix_cache_report(),
            **backend,
        }


def blocks_for_budget(program: Program, *, num_blocks=None, kv_cache_tokens=None, kv_cache_bytes_per_rank=None,
                      max_model_len: int, max_num_seqs: int) -> int:
    """Cache size in blocks from whichever budget the user gave (default: every sequence slot
    at ``max_model_len``)."""
    per_block = kv_bytes_per_block(program)
    tokens_per_block = int(program.options["block_size"]) * program.mesh.dcp
    given = [x is not None for x in (num_blocks, kv_cache_tokens, kv_cache_bytes_per_rank)]
    if sum(given) > 1:
        raise ValueError("give at most one of num_blocks, kv_cache_tokens, kv_cache_bytes_per_rank")
    if num_blocks is not None:
        return int(num_blocks)
    if kv_cache_bytes_per_rank is not None:
        return max(1, int(kv_cache_bytes_per_rank) // per_block)
    tokens = kv_cache_tokens if kv_cache_tokens is not None else max_model_len * max_num_seqs
    return max(1, math.ceil(tokens / tokens_per_block))


def _weight_bytes_per_rank(program) -> list[int]:
    from ..passes.tp_styles import weight_bytes_per_rank

    return weight_bytes_per_rank(program)
