"""Greedy rows of one step share one max over the batch (``model_runner._plain_greedy_tokens``):
plain greedy requests get HF ``generate``'s tokens, and requests beside them whose logits are
shaped (a repetition penalty) or sampled (seeded) get the tokens they get running alone, where
the per-request path samples them.

Model: ``build_model("llama")`` (fp64, 2 layers). References: HF ``generate`` on the same weights
and the engine with one request at a time.
"""

from __future__ import annotations

import pytest
import torch

import dcpgraph
from dcpgraph.models import build_model
from dcpgraph.runtime import model_runner
from dcpgraph.testing.generation import drain, hf_greedy

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [40, 41, 42, 43, 44], [9, 9, 9, 2]]
SHAPED = [{"repetition_penalty": 1.5}, {"temperature": 0.8, "seed": 3}]
NEW = 6


# slow: 20-26 s on the loaded 2-core host (a trace, HF generate for 4 prompts, 3 engine runs).
@pytest.mark.slow
def test_greedy_rows_batched_beside_shaped_and_sampled_rows(monkeypatch):
    model = build_model("llama", dtype=torch.float64)
    program = dcpgraph.trace(model)
    engine = dcpgraph.compile(program, tp=1, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                              max_model_len=32)
    alone = []
    for kwargs in SHAPED:
        rid = engine.add_request(PROMPTS[0], NEW, **kwargs)
        alone.append(drain(engine)[rid])
    batched = []
    original = model_runner._plain_greedy_tokens
    monkeypatch.setattr(model_runner, "_plain_greedy_tokens",
                        lambda *a: batched.append(len(picked := original(*a))) or picked)
    greedy_ids = [engine.add_request(p, NEW) for p in PROMPTS]
    shaped_ids = [engine.add_request(PROMPTS[0], NEW, **kwargs) for kwargs in SHAPED]
    out = drain(engine)
    assert max(batched) == len(PROMPTS)  # every plain greedy row of a full step in one reduction
    assert [out[r] for r in greedy_ids] == [hf_greedy(model, p, NEW) for p in PROMPTS]
    assert [out[r] for r in shaped_ids] == alone
