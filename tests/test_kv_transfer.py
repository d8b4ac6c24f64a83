"""Prefill/decode disaggregation: KV exported by one engine continues on another DCP layout."""

from __future__ import annotations

from types import SimpleNamespace

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


def test_a_different_tp_continues_where_every_cache_is_whole_on_every_rank(setup):
    """Both models keep the whole KV on every rank (llama's single KV head, MLA's latent), so a
    tp=2 prefill continues at tp=1 from the producer's first copy."""
    program, refs = setup
    transfer = dcpgraph.compile(program, tp=2, dcp=1, block_size=4).prefill(PROMPTS[0])
    other = dcpgraph.compile(program, tp=1, block_size=4)
    rid = other.continue_from(transfer, NEW)
    assert list(transfer.tokens[transfer.prompt_len:]) + drain(other)[rid] == refs[0]


def _split_heads_engine(tp: int, kv_heads: int):
    """An engine's face as ``check_transfer`` reads it: a GQA model with ``kv_heads`` KV heads split
    over ``tp`` emulated ranks (one cache of ``kv_heads // tp`` heads, at least 1, per rank)."""
    facts = SimpleNamespace(attention="gqa", num_kv_heads=kv_heads, layer_kv_heads=())
    cache = SimpleNamespace(name="k_0", heads=max(kv_heads // tp, 1), dim=8, dtype=torch.float32)
    program = SimpleNamespace(facts=facts, caches=(cache,), recurrent_states=(),
                              lowering=SimpleNamespace(sliding_caches=()))
    executor = SimpleNamespace(local_ranks=tuple(range(tp)), mode="emulated", rank_caches=lambda rank: {})
    return SimpleNamespace(program=program, executor=executor, mesh=SimpleNamespace(tp=tp, ranks=range(tp)))


def test_a_different_tp_is_refused_where_kv_heads_are_split():
    """Two KV heads at tp=2 and tp=4: one head per rank on both sides (the same cache layout), but
    rank 1 holds head 1 at tp=2 and head 0 at tp=4, so the copies differ and tp must be equal."""
    from dcpgraph.runtime.kv_transfer import KVTransfer, _layout_key, check_transfer

    producer, consumer = _split_heads_engine(2, 2), _split_heads_engine(4, 2)
    assert _layout_key(producer) == _layout_key(consumer)
    transfer = KVTransfer((1, 2), 2, 2, 2, ({}, {}), _layout_key(producer))
    with pytest.raises(dcpgraph.RequestError, match="tp may differ only where every cache and state is whole"):
        check_transfer(consumer, transfer)
    check_transfer(_split_heads_engine(2, 2), transfer)  # the same tp takes it
    whole = KVTransfer((1, 2), 2, 2, 2, ({}, {}), _layout_key(_split_heads_engine(2, 1)))
    check_transfer(_split_heads_engine(4, 1), whole)  # a single KV head: every rank's copy is the same


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
