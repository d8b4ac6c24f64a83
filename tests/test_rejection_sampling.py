"""Rejection sampling is lossless: speculative output has exactly the target's distribution.

The reference is independent of the engine: a Markov chain over 5 tokens whose exact sequence
probabilities are products of its transition matrix. Speculative steps draw drafts from a
deliberately different chain (or deterministic one-hot drafts, as prompt lookup gives) and
:func:`rejection_sample` decides; the empirical distribution of the first 3 emitted tokens
(125 outcomes) must pass a chi-square goodness-of-fit test against the target chain at
p > 0.001 (fixed seeds, 12,000 sequences), and the same test must reject (p < 1e-6) a sabotaged
acceptance rule that keeps every draft.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dcpgraph.runtime import rejection
from dcpgraph.runtime.rejection import accept, probabilities, rejection_sample
from dcpgraph.runtime.sampling import SamplingParams, sample

V, LENGTH, K, SAMPLES = 5, 3, 2, 12_000


def chain(seed: int, sharpness: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharpness * torch.randn(V, V, generator=g, dtype=torch.float64), -1)


TARGET, DRAFT = chain(0, 1.5), chain(1, 1.5)


def chi_square_p_value(counts: dict, probs: dict, n: int) -> float:
    """Pearson's test, cells with expected count < 5 pooled into one; p from the chi-square
    survival function (the regularised upper incomplete gamma)."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0.0, 0.0, 0
    for outcome, p in probs.items():
        expected, observed = n * p, counts.get(outcome, 0)
        if expected < 5:
            pooled_obs += observed
            pooled_exp += expected
            continue
        stat += (observed - expected) ** 2 / expected
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    outside = sum(c for o, c in counts.items() if o not in probs)
    if outside:
        return 0.0  # an outcome the target cannot produce
    df = cells - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def exact_sequence_probs() -> dict:
    return {seq: float(TARGET[0, seq[0]] * TARGET[seq[0], seq[1]] * TARGET[seq[1], seq[2]])
            for seq in itertools.product(range(V), repeat=LENGTH)}


def speculative_sequence(gen: torch.Generator, one_hot: bool) -> tuple[int, ...]:
    """The first LENGTH tokens after token 0, emitted in speculative steps of up to K drafts."""
    out = [0]
    while len(out) <= LENGTH:
        room = min(K, LENGTH - len(out))  # like the scheduler: never draft past the last token
        drafts, previous = [], out[-1]
        for _ in range(room):
            if one_hot:
                drafts.append(int(DRAFT[previous].argmax()))
            else:
                drafts.append(int(torch.multinomial(DRAFT[previous], 1, generator=gen)))
            previous = drafts[-1]
        context = [out[-1], *drafts]
        target = torch.stack([TARGET[t] for t in context])
        draft_probs = None if one_hot or not drafts else torch.stack([DRAFT[t] for t in context[:-1]])
        emitted = rejection_sample(target, drafts, draft_probs, gen)
        out.extend(emitted[: accept(drafts, emitted) + 1])  # what the scheduler keeps
    return tuple(out[1 : LENGTH + 1])


def empirical(one_hot: bool, seed: int = 1234) -> dict:
    gen = torch.Generator().manual_seed(seed)
    counts: dict = {}
    for _ in range(SAMPLES):
        seq = speculative_sequence(gen, one_hot)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-distribution", "one-hot-drafts"])
def test_speculative_sampling_matches_the_target_distribution(one_hot):
    p = chi_square_p_value(empirical(one_hot), exact_sequence_probs(), SAMPLES)
    assert p > 1e-3, f"chi-square p-value {p:.2e}: speculative sampling changed the distribution"


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-distribution", "one-hot-drafts"])
def test_an_always_accept_rule_fails_the_same_test(monkeypatch, one_hot):
    monkeypatch.setattr(rejection, "acceptance_probability", lambda p, q: 1.0)
    p = chi_square_p_value(empirical(one_hot), exact_sequence_probs(), SAMPLES)
    assert p < 1e-6, f"chi-square p-value {p:.2e}: the test cannot see a broken acceptance rule"


def test_the_test_detects_a_slightly_wrong_residual(monkeypatch):
    """Resampling from p instead of the residual max(0, p - q) is a subtler bug; it must fail too."""
    original = rejection.rejection_sample

    def from_p(target, drafts, draft_probs, generator):
        out = []
        for j, d in enumerate(drafts):
            p, q = target[j], (1.0 if draft_probs is None else float(draft_probs[j, d]))
            if float(torch.rand((), dtype=torch.float64, generator=generator)) < min(1.0, float(p[d]) / q):
                out.append(d)
                continue
            return out + [int(torch.multinomial(p, 1, generator=generator))]
        return out + [int(torch.multinomial(target[len(drafts)], 1, generator=generator))]

    monkeypatch.setitem(globals(), "rejection_sample", from_p)
    try:
        p = chi_square_p_value(empirical(False), exact_sequence_probs(), SAMPLES)
    finally:
        monkeypatch.setitem(globals(), "rejection_sample", original)
    assert p < 1e-6


def test_the_token_after_a_rejection_is_never_the_rejected_draft():
    """The residual is 0 at a rejected draft, so the common prefix of drafts and emitted tokens is
    exactly the accepted drafts (how the scheduler counts them)."""
    gen = torch.Generator().manual_seed(5)
    for _ in range(2000):
        drafts = [int(torch.multinomial(DRAFT[0], 1, generator=gen))]
        drafts.append(int(torch.multinomial(DRAFT[drafts[0]], 1, generator=gen)))
        target = torch.stack([TARGET[0], TARGET[drafts[0]], TARGET[drafts[1]]])
        emitted = rejection_sample(target, drafts, torch.stack([DRAFT[0], DRAFT[drafts[0]]]), gen)
        assert accept(drafts, emitted) == len(emitted) - 1


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
                                    SamplingParams(temperature=0.9, top_p=0.8),
                                    SamplingParams(temperature=1.0, top_k=20, top_p=0.5)])
def test_probabilities_are_the_distribution_sample_draws_from(params):
    """Same generator state, same draw: ``sample`` and a multinomial over :func:`probabilities`
    pick the same token, so verification compares against exactly what plain decoding samples."""
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    batched = probabilities(logits, params)
    for i, row in enumerate(logits):
        a, b = torch.Generator().manual_seed(i), torch.Generator().manual_seed(i)
        assert sample(row, params, a) == int(torch.multinomial(batched[i], 1, generator=b))
        torch.testing.assert_close(batched[i], probabilities(row, params), rtol=0, atol=0)
