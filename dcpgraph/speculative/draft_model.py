"""A draft model (``method="draft_model"``): a smaller causal LM proposes, the target verifies.

The draft is compiled by the same pipeline on the same mesh (same ``tp``, ``dcp``, block size,
interleave, comm and KV dtype) and runs on its own executor with its **own KV cache** of the same
number of blocks (so each block is smaller: fewer layers and heads). It shares the target's
block tables: a request's draft KV for global position ``t`` lives in the same virtual block and
the same DCP rank as the target's (``layout.slot_mapping`` of the same table), so the DCP layout,
prefix-cache hits and preemption carry over unchanged.

Keeping the draft KV in step (per request, :attr:`DraftModelProposer.valid`): ``valid`` is how
many leading tokens of the request have correct draft KV. When a chunk gets ``k`` drafts at
position ``s`` (its last known token), the draft first catches up, running
``tokens[valid : s + 1]`` as one chunk (this is also the draft's prefill, done lazily the first
time the request drafts), then ``k − 1`` one-token steps on its own drafts. It has then written
positions ``< s + k``; after verification the target has ``computed = s + 1 + a`` correct tokens
(``a`` accepted drafts, which equal the tokens the draft wrote), so the draft's valid prefix is
``min(s + k, computed)`` — KV at rejected positions is simply overwritten next time, exactly like
the target's. A catch-up longer than the target's token budget (a long prompt) is first run in
forwards of at most ``max_batched_tokens`` tokens, like the target's chunked prefill. ``valid`` is clamped to ``computed`` on every call, so this needs no callback from
the scheduler. A request the proposer has not seen (new, or preempted since: the key includes
its preemption count) starts at ``valid = 0``: the draft recomputes its whole history, also the
part a prefix-cache hit spared the target (rewriting a shared block's draft KV with the values it
already holds, so other requests are unaffected), and never trusts draft KV it did not write.

Drafts of greedy requests are the draft's argmax; of sampled requests a draw from the draft's
distribution under the request's sampling parameters, with those distributions returned for
rejection sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ConfigError
from ..runtime.proposer import NO_DRAFTS, Drafts
from ..runtime.rejection import probabilities
from ..runtime.sampling import greedy_token
from ..runtime.step_inputs import Chunk


class DraftModelProposer:
    method = "draft_model"

    def __init__(self, runner, max_batched_tokens: int | None = None):
        self.runner = runner  # a ModelRunner over the draft program (no proposer of its own)
        self.max_batched_tokens = max_batched_tokens  # bound of one catch-up forward (None: none)
        self.valid: dict[tuple[int, int], int] = {}  # (request id, preemptions) -> draft KV prefix

    def propose(self, plan: Sequence) -> list[Drafts]:
        rows = [i for i, item in enumerate(plan) if item.draft_room > 0]
        tokens: dict[int, list[int]] = {i: [] for i in rows}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in rows}
        self._forget_finished(plan)
        valid = {i: min(self.valid.get(self._key(plan[i].request), 0), plan[i].chunk.start) for i in rows}
        self._catch_up(plan, valid)
        chunks = [Chunk(plan[i].request.id, tuple(plan[i].request.tokens[valid[i] : plan[i].chunk.start + 1]),
                        valid[i], plan[i].chunk.block_table) for i in rows]
        live = list(rows)
        step = 0
        while live:
            logits = self.runner.execute(chunks)
            for row, i in enumerate(live):
                self._choose(plan[i], logits[row], tokens[i], probs[i])
            step += 1
            live = [i for i in live if plan[i].draft_room > step]
            chunks = [Chunk(plan[i].request.id, (tokens[i][-1],), plan[i].chunk.start + step,
                            plan[i].chunk.block_table) for i in live]
        out = []
        for i, item in enumerate(plan):
            if i not in tokens:
                out.append(NO_DRAFTS)
                continue
            # written: positions < start + room; the request's next computed clamps it on the next call
            self.valid[self._key(item.request)] = item.chunk.start + item.draft_room
            p = torch.stack(probs[i]) if probs[i] else None
            out.append(Drafts(tokens[i], p))
        return out

    def _catch_up(self, plan: Sequence, valid: dict[int, int]) -> None:
        """Run the draft over history it has not cached, in forwards of at most
        ``max_batched_tokens`` tokens (the target's chunked-prefill budget), until every drafting
        row's remaining catch-up chunk fits one; ``valid`` moves on in place."""
        budget = self.max_batched_tokens
        if budget is None:
            return
        while True:
            behind = {i: plan[i].chunk.start + 1 - v for i, v in valid.items()}
            if sum(behind.values()) <= budget:
                return
            chunks, left = [], budget
            for i, n in behind.items():
                take = min(n - 1, left)  # keep the last token for the drafting forward
                if take <= 0:
                    continue
                item = plan[i]
                chunks.append(Chunk(item.request.id, tuple(item.request.tokens[valid[i] : valid[i] + take]),
                                    valid[i], item.chunk.block_table))
                valid[i] += take
                left -= take
                if left == 0:
                    break
            if not chunks:
                return
            self.runner.execute(chunks)

    @staticmethod
    def _key(request) -> tuple[int, int]:
        return request.id, request.preemptions

    def _forget_finished(self, plan: Sequence) -> None:
        """Bound the table: when it outgrows the plan, keep only the plan's requests (a running
        request left out merely recomputes its draft KV from 0 next time)."""
        if len(self.valid) > 4 * max(1, len(plan)):
            live = {self._key(item.request) for item in plan}
            self.valid = {k: v for k, v in self.valid.items() if k in live}

    @staticmethod
    def _choose(item, row: torch.Tensor, tokens: list[int], probs: list[torch.Tensor]) -> None:
        params = item.request.params
        if params.greedy:
            tokens.append(greedy_token(row))
            return
        q = probabilities(row, params)
        tokens.append(int(torch.multinomial(q, 1, generator=item.request.generator)))
        probs.append(q)

    def valid_prefix(self, request) -> int:
        """Tokens of ``request`` whose draft KV is known correct now (for tests and reports)."""
        return min(self.valid.get(self._key(request), 0), request.computed)


def check_draft(target_facts, draft_facts, mesh, *, block_size: int, interleave: int, max_model_len: int) -> None:
    """Refuse a draft that cannot serve this target on this mesh, naming the reason."""
    if draft_facts.vocab_size != target_facts.vocab_size:
        raise ConfigError(f"the draft model's vocabulary ({draft_facts.vocab_size}) differs from the target's "
                          f"({target_facts.vocab_size}): a draft must share the target's tokenizer")
    limit = draft_facts.extra.get("max_position_embeddings")
    if limit and limit < max_model_len:
        raise ConfigError(f"the draft model's max_position_embeddings ({limit}) is below max_model_len "
                          f"({max_model_len}): it could not draft for long requests")
    try:
        mesh.validate(attention=draft_facts.attention, num_q_heads=draft_facts.num_q_heads,
                      num_kv_heads=draft_facts.num_kv_heads, block_size=block_size, interleave=interleave,
                      layer_kv_heads=draft_facts.layer_kv_heads)
    except ConfigError as err:
        raise ConfigError(f"the draft model does not fit the mesh: {err}") from None

