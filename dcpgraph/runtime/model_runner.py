"""``ModelRunner``: turns a scheduled step into logits on every rank and tokens from them.

It owns everything between the scheduler's plan and the sampled tokens: prompt-lookup drafts
for the rows the scheduler gave room to (:mod:`.speculative`), the flattened per-rank step
inputs (:mod:`.step_inputs`), the static-shape decode buckets (:mod:`.graph_mode`), the executor
that runs the compiled program, and sampling. It never changes a request: what the tokens mean
(acceptance, stop conditions, ``computed``) is :meth:`Scheduler.postprocess`'s business.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ..program import Program
from .graph_mode import DecodeBuckets
from .sampling import sample, token_logprobs
from .scheduler import RowOutput, ScheduledChunk
from .speculative import propose
from .step_inputs import Chunk, build_step_inputs


class ModelRunner:
    def __init__(self, program: Program, executor, buckets: DecodeBuckets | None):
        self.program = program
        self.mesh = program.mesh
        self.block_size = int(program.options["block_size"])
        self.interleave = int(program.options.get("interleave", 1))
        self.executor = executor
        self.buckets = buckets
        self.steps = 0
        self.graph_steps: dict[str, int] = {}

    def run(self, plan: Sequence[ScheduledChunk]) -> list[RowOutput]:
        """One step of ``plan`` on every rank: per scheduled chunk, the sampled tokens."""
        drafts = [propose(item.request.tokens, item.draft_room) for item in plan]
        chunks = [_with_drafts(item.chunk, d) for item, d in zip(plan, drafts)]
        logits = self.execute(chunks)
        outputs, row = [], 0
        for item, chunk, draft in zip(plan, chunks, drafts):
            rows = logits[row : row + chunk.logits_rows]
            row += chunk.logits_rows
            if draft:  # verification: the target's greedy token after every query row
                tokens = [int(r.argmax()) for r in rows]
            elif item.samples:
                request = item.request
                tokens = [sample(rows[-1], request.params, request.generator, request.prompt, request.output)]
            else:
                tokens = []
            outputs.append(RowOutput(tokens, draft, _logprobs(item, rows, tokens)))
        return outputs

    def execute(self, chunks: list[Chunk]) -> torch.Tensor:
        """Logits ``[sum of logits_rows, V]`` of ``chunks``; a decode-only step runs in the
        smallest decode bucket that holds it (padded), anything else in the dynamic graph."""
        shared, per_rank = build_step_inputs(chunks, self.mesh, self.block_size, self.interleave)
        bucket = None
        if self.buckets is not None and all(len(c.tokens) == 1 for c in chunks):
            bucket = self.buckets.bucket_for(len(chunks))
        key, name = "mixed", "mixed"
        if bucket is not None:
            shared, per_rank = self.buckets.pad(shared, per_rank, bucket, self.mesh)
            key, name = ("decode", bucket), f"decode[{bucket}]"
        self.graph_steps[name] = self.graph_steps.get(name, 0) + 1
        logits = self.executor.run(shared, per_rank, key)
        self.steps += 1
        return logits


def _logprobs(item: ScheduledChunk, rows: torch.Tensor, tokens: list[int]) -> list[dict] | None:
    """Per token of ``tokens``, its log-probabilities from the row it was chosen from (the last
    ``len(tokens)`` rows), if the request asked for them."""
    top = item.request.params.logprobs
    if top is None or not tokens:
        return None
    return [token_logprobs(row, token, top) for row, token in zip(rows[len(rows) - len(tokens):], tokens)]


def _with_drafts(chunk: Chunk, drafts: list[int]) -> Chunk:
    """``chunk`` followed by ``drafts``, with a logits row for its last token and every draft."""
    if not drafts:
        return chunk
    return replace(chunk, tokens=chunk.tokens + tuple(drafts), logits_rows=1 + len(drafts))
