"""``ModelRunner``: turns a scheduled step into logits on every rank and tokens from them.

It owns everything between the scheduler's plan and the sampled tokens: drafts from the
proposer (:mod:`dcpgraph.speculative`) for the rows the scheduler gave room to, the flattened
per-rank step inputs (:mod:`.step_inputs`), the static-shape decode and verification buckets
(:mod:`.graph_mode`, :mod:`.verify_buckets`), the executor that runs the compiled program,
sampling, and verification of drafts (:func:`dcpgraph.runtime.rejection.verify`), each row masked
first by the request's grammar when it has one (:mod:`.grammar`; the grammar then advances over
the tokens the scheduler will emit: the accepted drafts and the token after them). It never
changes a request: what the tokens mean (acceptance, stop conditions, ``computed``) is
:meth:`Scheduler.postprocess`'s business.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ..program import Program
from . import state_rollback
from .graph_mode import DecodeBuckets
from .proposer import NO_DRAFTS
from .rejection import accept, verify
from .sampling import greedy_tokens, sample, token_logprobs
from .scheduler import RowOutput, ScheduledChunk
from .step_inputs import Chunk, TableRows, build_step_inputs
from .verify_buckets import VerifyBuckets


class ModelRunner:
    def __init__(self, program: Program, executor, buckets: DecodeBuckets | None, proposer=None,
                 verify_buckets: VerifyBuckets | None = None):
        self.program = program
        self.mesh = program.mesh
        self.block_size = int(program.lowering.block_size)
        self.interleave = int(program.lowering.interleave)
        self.executor = executor
        self.buckets = buckets
        self.proposer = proposer
        self.verify_buckets = verify_buckets
        self.eos_token_ids = tuple(int(t) for t in program.facts.eos_token_id)  # masked under min_tokens
        self.steps = 0
        self.dummy_steps = 0  # dummy_forward calls (a data-parallel replica stepping with no work)
        self.table_rows = TableRows()  # block-table rows of the last step, reused while unchanged
        self.graph_steps: dict[str, int] = {}
        self.last_hidden: torch.Tensor | None = None  # [tokens of the last step, H] (return_hidden)
        self.last_query_len: int | None = None  # q of the last step's verification bucket (None: unpadded rows)
        self.rollback = state_rollback.keeps_snapshots(program)  # recurrent state restored after rejected drafts
        self.replays = {"steps": 0, "rows": 0, "tokens": 0}  # replay steps of state_rollback

    def run(self, plan: Sequence[ScheduledChunk], state_copies: Sequence[tuple[int, int]] = ()) -> list[RowOutput]:
        """One step of ``plan`` on every rank: per scheduled chunk, the sampled tokens.
        ``state_copies``: recurrent-state rows to copy before it (the prefix cache's saves and
        restores, :mod:`.state_prefix_cache`), beside speculation's snapshots."""
        drafts = [NO_DRAFTS] * len(plan)
        if self.proposer is not None and any(item.draft_room for item in plan):
            drafts = self.proposer.propose(plan)
        chunks = [_with_drafts(item.chunk, d.tokens) for item, d in zip(plan, drafts)]
        snapshot = None
        if self.rollback and any(d.tokens for d in drafts):
            snapshot = state_rollback.snapshot_copies(chunks, state_rollback.snapshot_rows(self.program))
        copies = snapshot
        if state_copies:
            prefix = torch.tensor(list(state_copies), dtype=torch.int64)
            copies = prefix if snapshot is None else torch.cat([prefix, snapshot])
        logits = self.execute(chunks, copies)
        query_len = self.last_query_len
        if self.last_hidden is not None and hasattr(self.proposer, "observe"):
            self.proposer.observe(plan, chunks, self.last_hidden)  # MTP: the target's hidden states
        outputs, row, cached = [], 0, []  # cached: each chunk's tokens validly in the cache (for the replay)
        greedy = _plain_greedy_tokens(plan, chunks, drafts, logits)
        for i, (item, chunk, draft) in enumerate(zip(plan, chunks, drafts)):
            rows = logits[row : row + chunk.logits_rows]
            row += chunk.logits_rows
            prompt_logprobs = _prompt_logprobs(item, rows)  # from the model's rows, before any grammar mask
            request = item.request
            grammar = request.grammar
            if draft.tokens:  # verification: greedy agreement or rejection sampling
                checked = draft
                if grammar is not None:  # drafts cut at the first one the grammar refuses
                    rows, allowed = grammar.mask_verify_rows(rows, draft.tokens)
                    checked = replace(draft, tokens=allowed,
                                      probs=None if draft.probs is None else draft.probs[: len(allowed)])
                tokens = verify(rows, checked, request.params, request.generator)
            elif i in greedy:
                tokens = [greedy[i]]
            elif item.samples:
                if grammar is not None:
                    rows = grammar.mask(rows[-1])[None]
                tokens = [sample(rows[-1], request.params, request.generator, request.prompt, request.output,
                                 self.eos_token_ids)]
            else:
                tokens = []
            accepted = accept(draft.tokens, tokens) if draft.tokens else 0
            if grammar is not None and tokens:
                grammar.advance(tokens[: accepted + 1] if draft.tokens else tokens)
            outputs.append(RowOutput(tokens, draft.tokens, _logprobs(item, rows, tokens), prompt_logprobs))
            if snapshot is not None:
                cached.append(len(item.chunk.tokens) + accepted)
        if snapshot is not None:
            self._replay(chunks, cached, [query_len or len(c.tokens) for c in chunks])
        return outputs

    def dummy_forward(self) -> None:
        """One forward of one token that writes no KV (slot −1 on every rank) and whose logits are
        dropped: what a data-parallel replica with no work runs while the others step, so every
        rank of the EP group makes the same MoE collectives (its token is a row of its own; rows
        never mix, so it changes no other replica's result)."""
        shared, per_rank = build_step_inputs([Chunk(-1, (0,), 0, (0,))], self.mesh, self.block_size, self.interleave)
        per_rank = [{**own, "slot_mapping": torch.full_like(own["slot_mapping"], -1)} for own in per_rank]
        self.executor.run(shared, per_rank)
        self.dummy_steps += 1

    def _replay(self, ran: list[Chunk], kept: list[int], processed: list[int]) -> None:
        """Restore the state of every row that ran more tokens than it keeps and run its kept
        tokens again (:mod:`.state_rollback`); the replay's logits are dropped."""
        replay = state_rollback.replay_chunks(ran, kept, processed)
        if not replay:
            return
        hidden = self.last_hidden  # the verification step's, for a proposer that reads it
        self.execute(replay, state_rollback.restore_copies(replay, state_rollback.snapshot_rows(self.program)))
        self.last_hidden = hidden
        self.replays["steps"] += 1
        self.replays["rows"] += len(replay)
        self.replays["tokens"] += sum(len(c.tokens) for c in replay)

    def execute(self, chunks: list[Chunk], state_copies: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[sum of logits_rows, V]`` of ``chunks``; a decode-only step runs in the
        smallest decode bucket that holds it (padded), a step of decode rows with drafts (every
        token a query row) in its verification bucket, anything else in the dynamic graph.
        ``state_copies``: recurrent-state rows every rank copies before the step (:mod:`.state_rollback`)."""
        shared, per_rank = build_step_inputs(chunks, self.mesh, self.block_size, self.interleave, self.table_rows)
        counts = [len(c.tokens) for c in chunks]
        key, name, pick = "mixed", "mixed", None
        if self.buckets is not None and all(n == 1 for n in counts):
            bucket = self.buckets.bucket_for(len(chunks))
            if bucket is not None:
                shared, per_rank = self.buckets.pad(shared, per_rank, bucket, self.mesh)
                key, name = ("decode", bucket), f"decode[{bucket}]"
        elif self.verify_buckets is not None and all(c.logits_rows == n for c, n in zip(chunks, counts)):
            bucket = self.verify_buckets.bucket_for(counts)
            if bucket is not None:
                pick = self.verify_buckets.real_rows(shared, [c.logits_rows for c in chunks])
                shared, per_rank = self.verify_buckets.pad(shared, per_rank, bucket, self.mesh)
                q = self.verify_buckets.query_len
                key, name = ("verify", f"{bucket}x{q}"), f"verify[{bucket}x{q}]"
        if state_copies is not None:
            shared = {**shared, state_rollback.STATE_COPIES: state_copies}
        self.last_query_len = self.verify_buckets.query_len if key[0] == "verify" else None
        self.graph_steps[name] = self.graph_steps.get(name, 0) + 1
        logits = self.executor.run(shared, per_rank, key)
        self.last_hidden = _real_hidden(getattr(self.executor, "last_hidden", None), counts,
                                        self.verify_buckets.query_len if key[0] == "verify" else None)
        self.steps += 1
        return logits if pick is None else logits[pick]


def _real_hidden(hidden: torch.Tensor | None, counts: list[int], query_len: int | None) -> torch.Tensor | None:
    """The rows of the step's real tokens, in order: a padded decode bucket appends padding
    after them, a verification bucket puts request ``i``'s tokens at ``i · query_len``."""
    if hidden is None:
        return None
    if query_len is None:
        return hidden[: sum(counts)]
    return hidden[torch.cat([torch.arange(n) + i * query_len for i, n in enumerate(counts)])]


def _logprobs(item: ScheduledChunk, rows: torch.Tensor, tokens: list[int]) -> list[dict] | None:
    """Per token of ``tokens``, its log-probabilities from the row it was chosen from, if the
    request asked for them: a verified chunk's tokens come from its first ``len(tokens)`` rows
    (accepted drafts, then the target's token), a sampled chunk's one token from its last row."""
    top = item.request.params.logprobs
    if top is None or not tokens:
        return None
    chosen_from = rows[: len(tokens)] if len(tokens) > 1 or len(rows) == 1 else rows[-1:]
    return [token_logprobs(row, token, top) for row, token in zip(chosen_from, tokens)]


def _prompt_logprobs(item: ScheduledChunk, rows: torch.Tensor) -> list[dict] | None:
    """The prompt log-probabilities this chunk adds: the row of position ``p`` scores prompt token
    ``p + 1``, so a chunk at ``start`` with one row per token covers prompt tokens
    ``start + 1 .. start + n`` (the last prompt position's row scores the first output token
    instead). Tokens already recorded (a chunk recomputed after a preemption) are skipped."""
    request = item.request
    if not request.needs_prompt_logprobs:
        return None
    chunk, prompt = item.chunk, request.prompt
    if chunk.logits_rows != len(chunk.tokens):
        raise AssertionError(f"a prompt-logprobs chunk needs a logits row per token, got {chunk.logits_rows} "
                             f"for {len(chunk.tokens)}")
    first = len(request.prompt_logprobs)  # the next prompt token without an entry
    stop = min(chunk.start + len(chunk.tokens), len(prompt) - 1)  # positions whose next token is a prompt token
    top = request.params.prompt_logprobs
    return [token_logprobs(rows[p - chunk.start], prompt[p + 1], top)
            for p in range(max(chunk.start, first - 1), stop)]


def _plain_greedy_tokens(plan: Sequence[ScheduledChunk], chunks: Sequence[Chunk], drafts, logits: torch.Tensor
                         ) -> dict[int, int]:
    """{plan index: token} for every row that samples greedily from its model logits as they are
    (no drafts, no grammar, no logits shaping), from one ``greedy_tokens`` over their last logits
    rows: per row the same first-maximum index :func:`sample` picks, in one reduction instead of
    one per request. Empty for fewer than two such rows (``sample`` then runs as for the rest)."""
    picks, rows, row = [], [], 0
    for i, (item, chunk, draft) in enumerate(zip(plan, chunks, drafts)):
        row += chunk.logits_rows
        params = item.request.params
        if (item.samples and chunk.logits_rows > 0 and not draft.tokens and item.request.grammar is None
                and params.greedy and not params.modifies_logits):
            picks.append(i)
            rows.append(row - 1)
    if len(picks) < 2:
        return {}
    tokens = greedy_tokens(logits.index_select(0, torch.tensor(rows, device=logits.device)))
    return dict(zip(picks, tokens))


def _with_drafts(chunk: Chunk, drafts: list[int]) -> Chunk:
    """``chunk`` followed by ``drafts``, with a logits row for its last token and every draft."""
    if not drafts:
        return chunk
    return replace(chunk, tokens=chunk.tokens + tuple(drafts), logits_rows=1 + len(drafts))
