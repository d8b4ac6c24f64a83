"""Greedy sampling of a bf16 logits row casts it to fp32 first (bf16 → fp32 is exact, and torch's
CPU argmax over bf16 is ~3× slower): the token must be the bf16 row's own first maximum."""

from __future__ import annotations

import torch

from dcpgraph.runtime.sampling import SamplingParams, sample


def test_greedy_on_bf16_logits_is_the_first_maximum_of_the_row():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        row = torch.randn(3000, generator=gen).bfloat16()
        row[int(torch.randint(0, 3000, (1,), generator=gen))] = 9.0
        row[int(torch.randint(0, 3000, (1,), generator=gen))] = 9.0  # a tie (or the same slot)
        want = int(torch.nonzero(row == row.max())[0])
        assert sample(row, SamplingParams(temperature=0.0), None) == want == int(torch.argmax(row))
