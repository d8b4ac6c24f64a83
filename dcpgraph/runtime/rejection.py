"""Verification of drafts: greedy agreement, or lossless rejection sampling.

Greedy requests: the target's argmax after every query row is returned (``1 + k`` tokens) and
the scheduler keeps the drafts up to the first disagreement plus the target's token there, so the
output is token-identical to one-token greedy decoding.

Sampled requests (Leviathan et al. / Chen et al. speculative sampling): with ``p_j`` the target's
distribution after row ``j`` and ``q_j`` the one draft ``d_j`` was drawn from (one-hot for
deterministic drafts), draft ``j`` is accepted with probability
``min(1, p_j(d_j) / q_j(d_j))``; the first rejected position instead emits a token drawn from the
residual ``max(0, p_j - q_j)`` normalised; if all ``k`` are accepted a bonus token is drawn from
``p_{k+1}``. Each emitted token then has exactly the target's distribution. Every random draw
uses the request's own generator, so a seeded request reproduces. The residual is zero at a
rejected draft (``p_j(d_j) < q_j(d_j)`` there), so the emitted token after ``a`` acceptances
differs from ``d_{a+1}`` and :func:`~dcpgraph.speculative.ngram`'s prefix rule recovers ``a``.

``p`` and ``q`` go through the same temperature / min-p / top-k / top-p processing as
:func:`dcpgraph.runtime.sampling.sample` (:func:`~dcpgraph.runtime.sampling.probabilities`, the
one function both call). A request whose logits are shaped otherwise (penalties, ``logit_bias``,
...) is never verified here: it gets no drafts (``SamplingParams.modifies_logits``).
"""

from __future__ import annotations

import torch

from ..runtime.sampling import greedy_tokens, probabilities
from ..runtime.sampling_params import SamplingParams
from .proposer import Drafts


def acceptance_probability(p_draft: float, q_draft: float) -> float:
    """``min(1, p(d) / q(d))``: the probability that draft ``d`` is kept."""
    return 1.0 if p_draft >= q_draft else p_draft / q_draft


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def rejection_sample(target: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None) -> list[int]:
    """Emitted tokens (accepted drafts, then one more) from target distributions ``[k+1, V]``
    and the drafts' proposal distributions ``[k, V]`` (``None``: one-hot)."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        p = target[j]
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
        u = float(torch.rand((), dtype=torch.float64, generator=generator))
        if u < acceptance_probability(float(p[d]), q_d):
            out.append(d)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0
        else:
            residual = torch.clamp(p - draft_probs[j].to(p.dtype), min=0)
        total = float(residual.sum())
        out.append(_draw(residual / total if total > 0 else p, generator))
        return out
    out.append(_draw(target[len(drafts)], generator))
    return out


def verify(rows: torch.Tensor, drafts: Drafts, params: SamplingParams, generator: torch.Generator | None) -> list[int]:
    """Tokens for a chunk verified with ``drafts`` from its ``1 + k`` logits rows (see above)."""
    if params.greedy:
        return greedy_tokens(rows)
    return rejection_sample(probabilities(rows, params), drafts.tokens, drafts.probs, generator)


def accept(drafts: list[int], tokens: list[int]) -> int:
    """How many drafts the verified ``tokens`` confirm (``tokens[j]`` follows draft ``j``): the
    length of the common prefix."""
    accepted = 0
    while accepted < len(drafts) and accepted < len(tokens) and tokens[accepted] == drafts[accepted]:
        accepted += 1
    return accepted
