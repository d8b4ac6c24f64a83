"""The MTP tests' independent draft reference, shared by tests/test_mtp.py and tests/test_pcp_mtp.py:
a recorder of every draft an engine's proposer makes, and an eager loop of
:class:`~dcpgraph.speculative.mtp_module.MTPModule` (PyTorch SDPA over the whole sequence, no
paged cache, no DCP or PCP) fed the HF target's final hidden states."""

from __future__ import annotations

import torch

from dcpgraph.testing.generation import hf_reference


def record_drafts(engine) -> list[tuple[list[int], int, list[int]]]:
    """Wrap the engine's proposer: every (request tokens, chunk start, drafts) it proposes."""
    proposer = engine.runner.proposer
    seen, propose = [], proposer.propose

    def recording(plan):
        out = propose(plan)
        seen.extend((list(item.request.tokens), item.chunk.start, list(d.tokens))
                    for item, d in zip(plan, out) if d.tokens)
        return out

    proposer.propose = recording
    return seen


def eager_drafts(target, mtp, tokens: list[int], s: int, k: int) -> list[int]:
    """Greedy drafts after ``tokens[: s + 1]`` by an eager loop of the MTP module: positions
    ``t < s`` read ``(tokens[t+1], h_t)`` with ``h`` the target's final hidden states (after its
    norm), each further draft the previous draft and the MTP's own output state."""
    with torch.no_grad(), hf_reference(target):
        h = target.model(input_ids=torch.tensor([tokens[: s + 1]]), use_cache=False).last_hidden_state[0]
        ids, hidden, drafts = list(tokens[1 : s + 1]), list(h[:s]), []
        for _ in range(k):
            logits, x = mtp(torch.tensor([ids]), torch.arange(len(ids))[None], torch.stack(hidden)[None])
            drafts.append(int(logits[0, -1].argmax()))
            ids.append(drafts[-1])
            hidden.append(x[0, -1])
    return drafts
