"""Token sampling (vLLM's order): the logits-shaping fields, penalties, then greedy or
temperature / min-p / top-k / top-p with a per-request seed; and the log-probabilities of what was
sampled.

Logits shaping (:func:`process_logits`, vLLM's order, for greedy and sampled requests alike, on a
float64 copy; the raw row is returned untouched when the request sets none of them):
``allowed_token_ids`` (all others ``-inf``), ``bad_words_token_ids`` (a sequence's last token is
``-inf`` when the output ends with the rest of it), ``min_tokens`` (while fewer tokens are out,
EOS unless ``ignore_eos`` and ``stop_token_ids`` are ``-inf``), ``logit_bias`` (added), then:

Penalties (vLLM's semantics, applied to the raw logits in this order, before temperature, for
greedy and sampled requests alike):

* ``repetition_penalty`` ``r`` (1 = off): every token that occurs in the prompt *or* the output
  has its logit ``l`` replaced by ``l / r`` if ``l > 0`` else ``l · r`` (HF's
  ``RepetitionPenaltyLogitsProcessor``);
* ``frequency_penalty`` ``f``: ``l −= f · count(token in the output)``;
* ``presence_penalty`` ``p``: ``l −= p`` for every token that occurs in the output.

The parameters are :class:`~.sampling_params.SamplingParams` (vLLM's class, re-exported here);
a request is greedy when its temperature is below ``1e-5``.

Log-probabilities (:func:`token_logprobs`) are vLLM's default ``raw_logprobs``: ``log_softmax``
of the model's logits row the token was sampled from, before penalties, temperature or top-k/p.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .sampling_params import MAX_LOGPROBS, SamplingParams

__all__ = ["MAX_LOGPROBS", "SamplingParams", "apply_penalties", "greedy_token", "greedy_tokens", "probabilities",
           "process_logits", "sample", "token_logprobs"]


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int], output: Sequence[int],
                   eos_token_ids: Sequence[int] = ()) -> torch.Tensor:
    """``logits [V]`` shaped by the request's fields and penalties (module docstring), as a new
    float64 row; ``logits`` itself when :attr:`SamplingParams.modifies_logits` is false."""
    if not params.modifies_logits:
        return logits
    scores = logits.double().clone()
    vocab = scores.numel()
    if params.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[torch.tensor(params.allowed_token_ids, dtype=torch.long)] = True
        scores.masked_fill_(~keep, float("-inf"))
    for ids in params.bad_words_token_ids or ():
        prefix = len(ids) - 1
        if prefix <= len(output) and (prefix == 0 or list(output[-prefix:]) == ids[:-1]):
            scores[ids[-1]] = float("-inf")
    if len(output) < params.min_tokens:
        stops = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(eos_token_ids))
        stops = sorted(t for t in stops if t < vocab)
        if stops:
            scores[torch.tensor(stops, dtype=torch.long)] = float("-inf")
    for token, bias in (params.logit_bias or {}).items():
        scores[token] += bias
    return apply_penalties(scores, params, prompt, output)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int],
                    output: Sequence[int]) -> torch.Tensor:
    """A penalized copy of a ``[V]`` logits row (the module docstring's formulas); ``logits``
    itself when no penalty is set."""
    if not params.penalized:
        return logits
    scores = logits.double().clone()
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        if seen.numel():
            picked = scores[seen]
            r = params.repetition_penalty
            scores[seen] = torch.where(picked > 0, picked / r, picked * r)
    if output and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(list(output), dtype=torch.long), minlength=scores.numel()).double()
        scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).double()
    return scores


def greedy_tokens(rows: torch.Tensor) -> list[int]:
    """Per row of ``rows [..., V]`` the index of its first largest value, NaN counting as largest:
    ``torch.argmax(rows, -1)``. Computed as ``torch.max(rows, -1).indices`` (documented to pick
    the first maximum, NaN included, as argmax does), in fp32 for bf16 rows (exact, so the same
    index): torch's CPU max reduction is vectorised and its argmax is not (16 rows of 32K:
    ~350 against ~740 µs)."""
    rows = rows.float() if rows.dtype in (torch.bfloat16, torch.float16) else rows
    return torch.max(rows, -1).indices.reshape(-1).tolist()


def greedy_token(logits: torch.Tensor) -> int:
    """:func:`greedy_tokens` of one ``[V]`` row."""
    return greedy_tokens(logits)[0]


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from for rows of (shaped) logits ``[..., V]``
    (float64): temperature, then ``min_p`` (drop tokens below ``min_p`` times the most likely
    one's probability), top-k, top-p (vLLM's order)."""
    scores = logits.double() / params.temperature
    if params.min_p > 0:
        probs = torch.softmax(scores, -1)
        scores = scores.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if params.top_k > 0:  # 0 and vLLM's -1 are off
        kth = torch.topk(scores, min(params.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_scores, -1)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p  # keep the first over p
        scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
    return torch.softmax(scores, -1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           prompt: Sequence[int] = (), output: Sequence[int] = (), eos_token_ids: Sequence[int] = ()) -> int:
    """One token id from a ``[V]`` row of logits; ``prompt`` and ``output`` (the request's tokens
    so far) feed the penalties and the output-dependent masks, ``eos_token_ids`` ``min_tokens``."""
    logits = process_logits(logits, params, prompt, output, eos_token_ids)
    if params.greedy:
        return greedy_token(logits)
    return int(torch.multinomial(probabilities(logits, params), 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> dict:
    """Log-probabilities of one sampled ``token`` from its raw ``[V]`` logits row, as JSON-able
    values: ``{"logprob": log p(token), "rank": 1 + #(tokens more likely), "top": [[id, log p],
    ...]}`` with the ``top`` most likely tokens, most likely first (computed in float64)."""
    logp = torch.log_softmax(logits.double(), -1)
    chosen = logp[token]
    values, ids = torch.topk(logp, min(top, logp.numel())) if top else (logp[:0], logp[:0].long())
    return {"logprob": float(chosen), "rank": int((logp > chosen).sum()) + 1,
            "top": [[int(i), float(v)] for i, v in zip(ids.tolist(), values.tolist())]}
