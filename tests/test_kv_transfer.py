"""Prefill/decode disaggregation: KV exported by one engine continues on another DCP layout."""

from __future__ import annotations

import pytest
import torch

import dcpgraph
from dcpgraph.models import build_model
from dcpgraph.testing.generation import drain, hf_greedy

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [3], [40, 41, 42, 43, 44, 45, 46]]
NEW = 12


@pytest.fixture(scope="module", params=["llama", "deepseek_v2"])
def setup(request):
    model = build_model(request.param, dtype=torch.float64)
    refs = [hf_greedy(model, p, NEW) for p in PROMPTS]
    return dcpgraph.trace(model), refs


@pytest.mark.parametrize(
    "prefill, decode",
    [
        (dict(dcp=1, interleave=1, block_size=4), dict(dcp=2, interleave=4, block_size=4)),  # P: no DCP, D: block interleave
        (dict(dcp=2, interleave=1, block_size=4), dict(dcp=1, interleave=1, block_size=8)),  # back, other block size
    ],
)
def test_decode_engine_continues_prefilled_requests(setup, prefill, decode):
    program, refs = setup
    p_engine = dcpgraph.compile(program, tp=2, **prefill)
    d_engine = dcpgraph.compile(program, tp=2, **decode)
    transfers = [p_engine.prefill(p) for p in PROMPTS]
    assert p_engine.blocks.free_blocks == p_engine.blocks.num_blocks  # nothing left behind
    ids = [d_engine.continue_from(t, NEW) for t in transfers]
    outputs = drain(d_engine)  # events carry the tokens after the transferred first one
    assert [list(t.tokens[t.prompt_len:]) + outputs[rid] for t, rid in zip(transfers, ids)] == refs


def test_transfer_refuses_a_different_tp(setup):
    program, _ = setup
    transfer = dcpgraph.compile(program, tp=2, dcp=1, block_size=4).prefill(PROMPTS[0])
    other = dcpgraph.compile(program, tp=1, block_size=4)
    with pytest.raises(dcpgraph.RequestError, match="same model and tp"):
        other.continue_from(transfer, NEW)
    assert not other.scheduler.has_work() and other.blocks.free_blocks == other.blocks.num_blocks


class _OneRankView:
    """The emulated executor seen as a process that holds only rank 0 (as a distributed rank
    does); its ``caches`` is still the per-rank list, so only asking the executor tells them apart."""

    mode = "distributed"

    def __init__(self, executor):
        self.caches, self.run = executor.caches, executor.run
        self.local_ranks = (0,)

    def rank_caches(self, rank):
        return self.caches[rank]


def test_transfer_asks_the_executor_which_ranks_it_holds(setup):
    program, _ = setup
    transfer = dcpgraph.compile(program, tp=2, dcp=1, block_size=4).prefill(PROMPTS[0])
    other = dcpgraph.compile(program, tp=2, block_size=4)
    other.executor = other.runner.executor = _OneRankView(other.executor)
    with pytest.raises(dcpgraph.RequestError, match=r"distributed executor holds ranks \[0\] of \[0, 1\]"):
        other.continue_from(transfer, NEW)
    with pytest.raises(dcpgraph.RequestError, match="every rank's cache"):
        other.prefill(PROMPTS[1])
    assert not other.scheduler.has_work() and other.blocks.free_blocks == other.blocks.num_blocks
