"""``Engine``: serves generation requests with a compiled per-rank program.

Requests are validated completely before any rank does any work: a request that can never be
served raises :class:`~dcpgraph.errors.RequestError` and leaves the engine, and every request
already running, untouched.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import RequestError
from ..kv_budget import blocks_for_budget, kv_bytes_per_block  # noqa: F401  (re-exported)
from ..program import Program
from ..recurrent_state import refuse_recurrent_state_features
from . import engine_reports
from .engine_client import EngineClient, run_rank_op
from .grammar import GrammarBackend
from .graph_mode import DecodeBuckets, default_buckets
from .layer_groups import make_block_manager
from .model_runner import ModelRunner
from .proposer import make_proposer
from .sampling_params import SamplingParams
from .scheduler import Request, Scheduler, StepEvent
from .speculative_config import speculative_config as speculative_config_of
from .verify_buckets import VerifyBuckets


def unseeded_stream(run_seed: int, request_id: int) -> int:
    """The generator seed of a sampled request without its own seed: ``(request_id + run_seed ·
    0x9E3779B1) mod 2^32``. A CPU generator keeps only a seed's low 32 bits (mt19937), so the
    run's seed is mixed in there: within one run every request id below 2^32 gets its own stream,
    another run seed shifts them all (seeds equal mod 2^32 share them), and seed 0 keys a
    request by its id alone."""
    return (request_id + run_seed * 0x9E3779B1) % 2**32


class Engine(EngineClient):
    """Serves generation requests: :class:`~.scheduler.Scheduler` decides each step and applies its
    results, :class:`~.model_runner.ModelRunner` runs it on every rank.

    Output reaches callers through :meth:`step`'s events (or :meth:`generate`'s return value); a
    request that finished or was aborted is no longer held anywhere, so the engine's memory is
    proportional to its live requests. At most ``max_waiting`` requests wait for admission
    (``None``: unbounded); past that :meth:`add_request` raises
    :class:`~.scheduler.QueueFullError`. KV blocks are allocated on demand, preempting the youngest
    request when the cache is full (``kv_allocation="whole_request"`` reserves ``prompt +
    max_new_tokens`` at admission instead and never preempts)."""

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
        speculative_config=None,
        draft=None,
        enable_prefix_caching: bool = False,
        max_waiting: int | None = 1024,
        kv_allocation: str = "on_demand",
        memory_sizing=None,
        seed: int = 0,
        prefix_caching_off_reason: str | None = None,
    ):
        speculative = speculative_config_of(speculative_config, speculative_tokens)
        draft_layers = sorted({p.layer for p in draft[0].recurrent_states}) if draft is not None else []
        # DeepSeek-V4's compressor open windows are rolled back like recurrent state, and its MTP
        # reads the verification step's hidden streams, which a replay leaves as they were
        recurrent_layers = {p.layer for p in program.recurrent_states if p.role != "open_window"}
        refuse_recurrent_state_features(sorted(recurrent_layers), speculative, draft_layers)
        if program.recurrent_states:
            snapshots = max_num_seqs if speculative is not None else None  # state_rollback's rows
            prefix_rows = max_num_seqs if enable_prefix_caching else None  # state_prefix_cache's rows
            lowering = program.lowering
            if (lowering.state_slots, lowering.state_snapshots, lowering.state_prefix_rows) != (
                    max_num_seqs, snapshots, prefix_rows):  # compile() sets all three on every rank's program
                program = program.replace(lowering=lowering.decided(
                    state_slots=max_num_seqs, state_snapshots=snapshots, state_prefix_rows=prefix_rows))
        self.program = program
        self.seed = seed  # the run's seed: unseeded requests' generators derive from it (see _new_request)
        self.memory_sizing = memory_sizing  # dcpgraph.memory.MemorySizing when a memory fraction chose num_blocks
        self.prefix_caching_off_reason = prefix_caching_off_reason  # why compile decided vLLM's default off
        self.mesh = program.mesh
        self.block_size = int(program.lowering.block_size)
        self.interleave = int(program.lowering.interleave)
        self.max_model_len = max_model_len
        self.speculative = speculative
        k = self.speculative.num_speculative_tokens if self.speculative else 0
        self.blocks, cache_blocks = make_block_manager(
            program, num_blocks, enable_prefix_caching=enable_prefix_caching, kv_allocation=kv_allocation,
            max_num_seqs=max_num_seqs, decode_tokens=1 + k,
            step_tokens=min(max_batched_tokens, max_model_len),
        )
        self.scheduler = Scheduler(self.blocks, max_batched_tokens, max_num_seqs,
                                   eos_token_ids=program.facts.eos_token_id, speculative_tokens=k,
                                   max_waiting=max_waiting, kv_allocation=kv_allocation,
                                   state_slots=program.lowering.state_slots or 0)
        if program.recurrent_states and enable_prefix_caching:  # the state after each cached prefix
            from .state_prefix_cache import StatePrefixCache

            self.scheduler.state_prefix = StatePrefixCache(max_num_seqs + (snapshots or 0), prefix_rows)
        buckets = verify_buckets = None
        if capture_limit > 0:
            width = math.ceil(max_model_len / (self.block_size * self.mesh.dcp))
            sizes = default_buckets(min(capture_limit, max_num_seqs))
            buckets = DecodeBuckets(sizes, width)
            if k:
                verify_buckets = VerifyBuckets(sizes, width, 1 + k)
        proposer = None
        if self.speculative is not None:
            # the draft's caches hold every block the target's (full-attention) tables name, V4's
            # scratch block 0 included
            draft_blocks = cache_blocks["full"] if isinstance(cache_blocks, dict) else cache_blocks
            proposer = make_proposer(self.speculative, draft, executor_cls=executor_cls, num_blocks=draft_blocks,
                                     buckets=buckets, max_batched_tokens=max_batched_tokens)
        self.runner = ModelRunner(program, executor_cls(program, cache_blocks, graphs), buckets, proposer,
                                  verify_buckets)
        self.executor = self.runner.executor
        self.graphs = graphs
        self.speculative_tokens = k
        self._next_id = 0
        self.grammar_backend = None  # set by enable_structured_outputs
        from .capture import capture_graphs

        capture_graphs(self.runner, graphs)  # every graph compiled before any request

    @property
    def steps(self) -> int:
        """Steps run so far (on every rank)."""
        return self.runner.steps

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

    def add_request(self, prompt: Sequence[int], max_new_tokens: int, *, params: SamplingParams | None = None,
                    **sampling: Any) -> int:
        """Queue one request; returns its id. Raises ``RequestError`` before queuing anything
        (``QueueFullError``, a ``RequestError``, when ``max_waiting`` requests already wait).

        Sampling: the keywords of :data:`~.sampling_params.ENGINE_FIELDS` (greedy unless
        ``temperature`` > 0), or ``params=SamplingParams(...)`` (its per-token fields; ``n``,
        ``max_tokens`` and the stop conditions are the offline API's and the server's)."""
        tokens = self.check_request(prompt, max_new_tokens)
        request = self._new_request(tokens, max_new_tokens, SamplingParams.for_engine(params, **sampling))
        self.scheduler.add(request)
        return request.id

    def _new_request(self, tokens: list[int], max_new_tokens: int, params: SamplingParams, index: int = 0,
                     transfer: str | None = None) -> Request:
        if transfer is not None and params.prompt_logprobs is not None:
            raise RequestError(f"prompt_logprobs is not supported with prefill/decode disaggregation ({transfer}): "
                               "the prompt's logits stay on the prefill engine; run the request on one engine")
        try:
            params.check_vocab(self.program.facts.vocab_size)  # before an id: nothing changes on a refusal
        except ValueError as err:
            raise RequestError(str(err)) from None
        grammar = self._grammar_for(params)  # a GrammarError (a RequestError) before an id too
        rid = self._next_id
        self._next_id += 1
        gen = None
        if not params.greedy:
            # A seeded request's stream depends on its seed and its index in its generate() call,
            # not on how many requests this engine served before (so the same seed reproduces the
            # same tokens on the same engine); an unseeded request's on the run's seed and its
            # request id (unseeded_stream), so the same requests in the same order reproduce a run.
            gen = torch.Generator().manual_seed(unseeded_stream(self.seed, rid) if params.seed is None
                                                else params.seed + index)
        request = Request(rid, tokens, max_new_tokens, params, gen, grammar=grammar)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # the first prompt token has no log-probability
        request.speculative = not params.modifies_logits  # drafts are verified against the raw argmax
        return request

    def enable_structured_outputs(self, backend) -> None:
        """Let requests carry ``structured_outputs``: ``backend`` is a
        :class:`~.grammar.GrammarBackend` (or its :meth:`~.grammar.GrammarBackend.serialize` text,
        from a front end in another process) for the tokenizer the requests' text is in."""
        if isinstance(backend, str):
            backend = GrammarBackend.from_serialized(backend)
        if backend.vocab_size != self.program.facts.vocab_size:
            raise ValueError(f"the grammar backend's vocabulary ({backend.vocab_size}) is not the model's "
                             f"({self.program.facts.vocab_size})")
        self.grammar_backend = backend

    def _grammar_for(self, params: SamplingParams):
        """A fresh grammar state for a request with ``structured_outputs`` (``None`` without)."""
        if params.structured_outputs is None:
            return None
        if self.grammar_backend is None:
            raise RequestError("structured_outputs need the tokenizer's grammar backend: the front end calls "
                               "Engine.enable_structured_outputs(GrammarBackend.from_tokenizer(...)) first")
        return self.grammar_backend.matcher(params.structured_outputs, params.structured_outputs_after_token)

    def abort(self, request_id: int) -> bool:
        """Stop a request now: its KV blocks are free on return and it emits no further events.
        Returns ``True`` if it was live (waiting or running); an id that already finished, was
        aborted or never existed is a no-op returning ``False`` (so a client that disconnects
        just as its request finishes is harmless)."""
        return self.scheduler.abort(request_id)

    def step(self) -> list[StepEvent]:
        """Run one scheduled step on every rank; returns one ``(request_id, token, finished)``
        :class:`~.scheduler.StepEvent` per emitted token. A finished request is dropped."""
        plan = self.scheduler.schedule()
        if not plan:
            if self.program.lowering.expert_ranks is not None:  # replicas share the experts: step in lockstep
                self.runner.dummy_forward()
            return self._idle()
        return self.scheduler.postprocess(plan, self.runner.run(plan, self.scheduler.take_state_copies()))

    def _idle(self) -> list[StepEvent]:
        if self.scheduler.has_work():
            raise RuntimeError("scheduler made no progress (cache too small for any waiting request)")
        return []

    def _require_idle(self, caller: str) -> None:
        if self.scheduler.has_work():
            raise RequestError(
                f"{caller}() steps the engine until its own requests finish, so it needs an idle engine: "
                f"{self.scheduler.live} request(s) added with add_request() are live (their tokens would "
                "be lost); step() them to completion or abort() them first"
            )

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, params: SamplingParams | None = None,
                 **sampling: Any) -> list[list[int]]:
        """New tokens of each prompt (greedy unless ``temperature`` > 0). All prompts are checked
        before any work starts; a bad one raises ``RequestError`` naming it. Sampling as in
        :meth:`add_request`; a seeded prompt ``i`` samples with ``seed + i``."""
        params = SamplingParams.for_engine(params, **sampling)
        checked = []
        for i, prompt in enumerate(prompts):
            try:
                checked.append(self.check_request(prompt, max_new_tokens))
            except RequestError as err:
                raise RequestError(f"prompt {i}: {err}") from None
        self._require_idle("generate")
        requests = [self._new_request(tokens, max_new_tokens, params, i) for i, tokens in enumerate(checked)]
        outputs: dict[int, list[int]] = {r.id: [] for r in requests}
        queue = deque(requests)  # fed as the waiting queue has room: any number of prompts
        while queue or self.scheduler.has_work():
            while queue and self.scheduler.can_add():
                self.scheduler.add(queue.popleft())
            for rid, token, _ in self.step():
                outputs[rid].append(token)
        return [outputs[r.id] for r in requests]

    # -- prefill/decode disaggregation -------------------------------------------------------
    def prefill(self, prompt: Sequence[int], *, params: SamplingParams | None = None, **sampling: Any):
        """Run ``prompt`` until its first token is sampled and export its KV
        (:class:`~dcpgraph.runtime.kv_transfer.KVTransfer`); the request then leaves this engine.
        If that first token ends the request (an EOS id) the transfer is ``finished`` and carries
        no KV: there is nothing to continue."""
        from .kv_transfer import check_exportable, export_kv, finished_transfer

        check_exportable(self)
        self._require_idle("prefill")
        tokens = self.check_request(prompt, 2)
        request = self._new_request(tokens, 2, SamplingParams.for_engine(params, **sampling), transfer="prefill")
        request.speculative = False  # one token, exactly: drafts could finish it before the export
        self.scheduler.add(request)
        try:
            while not request.output:
                self.step()
            return finished_transfer(self, request) if request.finished else export_kv(self, request)
        finally:
            self.scheduler.abort(request.id)  # a no-op if it already finished

    def continue_from(self, transfer, max_new_tokens: int, *, params: SamplingParams | None = None,
                      **sampling: Any) -> int:
        """Continue a request exported by another engine's :meth:`prefill` (same model and tp,
        any dcp / interleave / block size): re-shards its KV into this engine's cache (and a hybrid
        model's recurrent state into the state slot it takes here) and runs it now (it takes a
        sequence slot and its blocks at once, or raises ``RequestError``).
        ``max_new_tokens`` counts the token the prefill engine sampled, so it must be >= 2; a
        ``finished`` transfer is refused (its request already ended)."""
        from .kv_transfer import check_transfer, import_kv

        check_transfer(self, transfer)
        if transfer.finished:
            raise RequestError("the transferred request already finished at its first token (an EOS id): "
                               "nothing to continue; its output is transfer.tokens[transfer.prompt_len:]")
        prompt = list(transfer.tokens[: transfer.prompt_len])
        output = list(transfer.tokens[transfer.prompt_len :])
        self.check_request(prompt, max_new_tokens)
        if max_new_tokens <= len(output):
            raise RequestError(f"max_new_tokens ({max_new_tokens}) counts the {len(output)} transferred token(s): "
                               f"give at least {len(output) + 1} to generate anything")
        request = self._new_request(prompt, max_new_tokens, SamplingParams.for_engine(params, **sampling),
                                    transfer="continue_from")
        request.output = output
        if request.grammar is not None:
            request.grammar.advance(output)  # the prefill engine's token, sampled under the same grammar
        request.computed = transfer.computed
        self.scheduler.adopt(request)
        try:
            import_kv(self, transfer, request)
        except BaseException:
            self.scheduler.abort(request.id)  # nothing half-written stays: its blocks and state slot are free
            raise
        return request.id

    def hold_for_transfer(self, request_id: int) -> tuple[list[int], int, int]:
        """Take running request ``request_id`` out of scheduling, keeping its KV blocks (and, for a
        hybrid model, its recurrent-state slot) for a cross-process transfer; returns ``(tokens,
        computed, prompt_len)``. Both stay allocated until :meth:`release_held`."""
        request = self.scheduler.detach(request_id)
        return list(request.tokens), request.computed, len(request.prompt)

    def release_held(self, request_id: int) -> bool:
        """Free the blocks and state slot of a request :meth:`hold_for_transfer` kept; ``False``
        if none are held."""
        if not self.blocks.holds(request_id) or self.scheduler.get(request_id) is not None:
            return False
        self.blocks.release(request_id)
        self.scheduler.release_state_slot(request_id)
        return True

    def adopt_transferred(self, prompt: Sequence[int], output: Sequence[int], max_new_tokens: int, *,
                          params: SamplingParams | None = None, **sampling: Any) -> tuple[int, int]:
        """Start a request whose prompt KV another engine computed and whose first ``output``
        tokens it sampled: returns ``(request id, start)``. Positions ``[start, len(prompt))`` must
        be written into its blocks before the next :meth:`step`; ``[0, start)`` are this engine's own
        prefix-cache hit. Raises ``RequestError`` (nothing held) if it cannot run now."""
        tokens = self.check_request(prompt, max_new_tokens)
        if max_new_tokens <= len(output):
            raise RequestError(f"max_new_tokens ({max_new_tokens}) counts the {len(output)} transferred token(s): "
                               f"give at least {len(output) + 1} to generate anything")
        request = self._new_request(tokens, max_new_tokens, SamplingParams.for_engine(params, **sampling),
                                    transfer="adopt_transferred")
        request.output = [int(t) for t in output]
        if request.grammar is not None:
            request.grammar.advance(request.output)
        request.computed = len(tokens)
        prefix = self.blocks.match_prefix(tokens)
        self.scheduler.adopt(request, prefix)
        return request.id, len(prefix) * self.blocks.tokens_per_block

    # -- reports ------------------------------------------------------------------------------
    def rank_call(self, name: str, args: dict) -> list:
        """The rank op: its driver half here, its rank half (if any) on every rank the executor runs."""
        return run_rank_op(self, name, args)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (:meth:`~.blocks.BlockManager.reset_prefix_cache`); the
        number of cached-free blocks freed (0 without prefix caching). Through a client:
        ``rank_call("reset_prefix_cache", {})``, which reaches every rank's engine."""
        if not self.blocks.enable_prefix_caching:
            return 0
        return self.blocks.reset_prefix_cache()

    def kv_usage_per_rank(self) -> list[tuple[int, int]]:
        """Every rank holds the same block table, so one figure serves them all."""
        used = self.blocks.num_blocks - self.blocks.free_blocks
        return [(used, self.blocks.num_blocks)] * self.mesh.tp

    # -- reports (dcpgraph.runtime.engine_reports) --------------------------------------------
    def memory_report(self) -> dict:
        return engine_reports.memory_report(self)

    def kv_sizing_report(self) -> dict:
        return engine_reports.kv_sizing_report(self)

    def prefix_cache_report(self) -> dict:
        return engine_reports.prefix_cache_report(self)

    def scheduler_report(self) -> dict:
        return engine_reports.scheduler_report(self)

    def speculative_report(self) -> dict:
        return engine_reports.speculative_report(self)

    def report(self) -> dict:
        return engine_reports.engine_report(self)
