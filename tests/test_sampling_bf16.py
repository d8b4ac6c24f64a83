"""Greedy tokens are ``torch.argmax``'s, computed as ``torch.max(dim).indices`` (vectorised on CPU)
and for bf16 rows in fp32 (exact): the token must be the row's own first maximum, NaN counting as
largest, whatever the dtype, ties and infinities."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpgraph.runtime.sampling import SamplingParams, greedy_token, greedy_tokens, sample


def test_greedy_on_bf16_logits_is_the_first_maximum_of_the_row():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        row = torch.randn(3000, generator=gen).bfloat16()
        row[int(torch.randint(0, 3000, (1,), generator=gen))] = 9.0
        row[int(torch.randint(0, 3000, (1,), generator=gen))] = 9.0  # a tie (or the same slot)
        want = int(torch.nonzero(row == row.max())[0])
        assert sample(row, SamplingParams(temperature=0.0), None) == want == int(torch.argmax(row))


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 4), width=st.integers(1, 300), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float64]),
       specials=st.lists(st.sampled_from([float("nan"), float("inf"), float("-inf"), 2.0]), max_size=4))
def test_greedy_tokens_equal_argmax_with_ties_nan_and_infinities(rows, width, seed, dtype, specials):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (rows, width), generator=gen).to(dtype)  # few values: many ties
    for value in specials:
        x[int(torch.randint(0, rows, (1,), generator=gen)), int(torch.randint(0, width, (1,), generator=gen))] = value
    want = [int(torch.argmax(r)) for r in x]
    assert greedy_tokens(x) == want
    assert [greedy_token(r) for r in x] == want
