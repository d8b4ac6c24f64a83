"""P/D with hybrid models in one process (qwen3_next's gated delta nets; in the slow tier also
bamba's Mamba-2 and lfm2's short convolutions): a request prefilled on one engine continues on another
with a different dcp, its recurrent state (every recurrent layer's conv and recurrent/SSM state
for its slot, per TP rank) travelling with its KV. Reference: HF ``generate`` greedy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import dcpgraph
from dcpgraph.serving.kv_connector.plan import KVSide, check_compatible
from dcpgraph.testing.generation import drain, hf_greedy
from tests.hybrid_models import MAMBA2_MESH_MODELS, MESH_MODELS, PROMPTS

NEW = 6
MODELS = {"qwen3_next": MESH_MODELS["qwen3_next"], "bamba": MAMBA2_MESH_MODELS["bamba"], "lfm2": MESH_MODELS["lfm2"]}
FAST = dict(block_size=4, capture_limit=0)  # no decode graphs: these tests time the transfer, not steps


# bamba's and lfm2's run in the slow tier: two tp=2 compiles take 10-40 s by load (one model is enough here)
@pytest.fixture(scope="module", params=["qwen3_next", pytest.param("bamba", marks=pytest.mark.slow),
                                        pytest.param("lfm2", marks=pytest.mark.slow)])
def hybrid(request):
    """One producer (tp2·dcp1) and one consumer (tp2·dcp2) per model, shared by the tests (each
    leaves them idle with every block and state slot free)."""
    model = MODELS[request.param]()
    program = dcpgraph.trace(model)
    return SimpleNamespace(
        name=request.param, program=program, refs=[hf_greedy(model, p, NEW) for p in PROMPTS],
        producer=dcpgraph.compile(program, tp=2, dcp=1, max_num_batched_tokens=8, **FAST),
        consumer=dcpgraph.compile(program, tp=2, dcp=2, max_num_seqs=4, **FAST))


def all_free(engine) -> bool:
    scheduler = engine.scheduler
    return (not scheduler.has_work() and engine.blocks.free_blocks == engine.blocks.num_blocks
            and sorted(scheduler.state_slots.free) == list(range(engine.program.lowering.state_slots)))


def test_decode_engine_continues_hybrid_requests_with_their_state(hybrid):
    transfers = [hybrid.producer.prefill(p) for p in PROMPTS]
    assert all(len(t.states) == 2 for t in transfers)  # one per TP rank
    assert all(float(s.abs().sum()) > 0 for t in transfers for s in t.states[1].values())  # state, not zeros
    assert all_free(hybrid.producer)
    ids = [hybrid.consumer.continue_from(t, NEW) for t in transfers]
    outputs = drain(hybrid.consumer)
    assert [list(t.tokens[t.prompt_len:]) + outputs[rid] for t, rid in zip(transfers, ids)] == hybrid.refs
    assert all_free(hybrid.consumer)


def test_a_transfer_without_its_state_is_refused_and_leaves_the_slot_free(hybrid):
    transfer = hybrid.producer.prefill(PROMPTS[0])
    stripped = type(transfer)(**{**transfer.__dict__, "states": ()})
    with pytest.raises(dcpgraph.RequestError, match="recurrent state for 0 rank"):
        hybrid.consumer.continue_from(stripped, NEW)
    assert all_free(hybrid.consumer)


def test_a_different_tp_is_refused_by_name(hybrid):
    transfer = hybrid.producer.prefill(PROMPTS[0])
    other_tp = dcpgraph.compile(hybrid.program, tp=1, **FAST)
    with pytest.raises(dcpgraph.RequestError, match="recurrent state is split over tp"):
        other_tp.continue_from(transfer, NEW)
    assert all_free(other_tp)


def test_a_failed_import_frees_the_adopted_slot(hybrid, monkeypatch):
    transfer = hybrid.producer.prefill(PROMPTS[1])
    from dcpgraph.runtime import kv_transfer

    def broken(engine, transfer, request):
        assert request.state_slot is not None  # adoption took a slot
        raise RuntimeError("the copy failed half-way")

    monkeypatch.setattr(kv_transfer, "import_kv", broken)
    with pytest.raises(RuntimeError, match="half-way"):
        hybrid.consumer.continue_from(transfer, NEW)
    assert all_free(hybrid.consumer)


def test_a_detached_request_keeps_its_state_slot_until_released():
    """A prefilled request held for a cross-process transfer keeps its slot, so admission cannot
    hand it (and overwrite its state) to another request before the send; released, it is free."""
    from dcpgraph.runtime.blocks import BlockManager
    from dcpgraph.runtime.sampling_params import SamplingParams
    from dcpgraph.runtime.scheduler import Request, Scheduler

    scheduler = Scheduler(BlockManager(8, 4), 16, 1, state_slots=1)
    held, waiting, adopted = (Request(i, [1, 2, 3], 2, SamplingParams()) for i in range(3))
    scheduler.add(held)
    assert [item.request for item in scheduler.schedule()] == [held] and held.state_slot == 0
    scheduler.detach(held.id)
    assert scheduler.held_state_slot(held.id) == 0 and scheduler.state_slots.free == []
    scheduler.add(waiting)
    assert scheduler.schedule() == []  # waits: the only slot is kept
    with pytest.raises(dcpgraph.RequestError, match="no free recurrent-state slot"):
        scheduler.adopt(adopted)
    assert scheduler.release_state_slot(held.id) and not scheduler.release_state_slot(held.id)
    scheduler.blocks.release(held.id)
    assert [item.request for item in scheduler.schedule()] == [waiting] and waiting.state_slot == 0


class _Mailbox:
    """An in-memory stand-in for the connector's data plane: a producer rank's ``exchange`` posts
    its buffers, a consumer rank's takes the ones addressed to it (the ranks run one after
    another here, so nothing waits)."""

    def __init__(self):
        self.posted: dict[tuple[int, int], object] = {}

    def connector(self):
        return self

    def exchange(self, transfer_id, rank, size, sends, recv_bytes):
        for dst, buf in sends.items():
            self.posted[(rank, dst)] = buf
        received = {src: self.posted.pop((src, rank)) for src in recv_bytes}
        assert {src: len(buf) for src, buf in received.items()} == recv_bytes
        return received


def test_connector_rank_halves_move_kv_and_state(hybrid, monkeypatch):
    """The cross-process path's rank halves (``kv.send`` on each producer rank, ``kv.recv`` on each
    consumer rank) with the connector's data plane replaced by a mailbox: the state rides in the
    same-index pair's buffer, and the consumer's tokens equal HF's."""
    from dcpgraph.runtime.engine_client import RankState
    from dcpgraph.serving.kv_connector import rank_ops

    mailbox = _Mailbox()
    monkeypatch.setattr(rank_ops, "parse_kv_transfer_config", lambda config: mailbox)
    producer, consumer = hybrid.producer, hybrid.consumer
    p_side, c_side = rank_ops.side(producer), rank_ops.side(consumer)
    assert p_side["states"] and p_side["states"] == c_side["states"]
    for prompt, ref in zip(PROMPTS, hybrid.refs):
        rid = producer.add_request(prompt, 2)
        while not producer.scheduler.get(rid).output:
            producer.step()
        tokens, computed, prompt_len = producer.hold_for_transfer(rid)
        c_rid, start = consumer.adopt_transferred(tokens[:prompt_len], tokens[prompt_len:], NEW)
        sent = [rank_ops.send_rows(RankState(r, producer.program, producer.executor.caches[r]),
                                   list(producer.blocks.table(rid)), rank_ops._state_slot(producer, rid), p_side,
                                   "t", c_side, start, computed, {}) for r in range(2)]
        got = [rank_ops.recv_rows(RankState(r, consumer.program, consumer.executor.caches[r]),
                                  list(consumer.blocks.table(c_rid)), rank_ops._state_slot(consumer, c_rid), c_side,
                                  "t", p_side, start, computed, {}) for r in range(2)]
        assert not mailbox.posted and sum(sent) == sum(got)
        state_bytes = KVSide.from_json(p_side).state_bytes
        assert state_bytes > 0 and sum(got) > 2 * state_bytes  # KV rows and each rank's state
        assert producer.release_held(rid)
        assert tokens[prompt_len:] + drain(consumer)[c_rid] == ref
    assert all_free(producer) and all_free(consumer)


def test_connector_refuses_a_different_tp_before_adopting():
    a = KVSide(2, 1, 1, 4, "gqa", 1, (("k", "k", 1, 8, "torch.float32"),), (("ssm_state_0", (4, 8, 8), "torch.float32"),))
    b = KVSide(4, 1, 1, 4, "gqa", 1, (("k", "k", 1, 8, "torch.float32"),), (("ssm_state_0", (2, 8, 8), "torch.float32"),))
    with pytest.raises(ValueError, match="same tp"):
        check_compatible(a, b)
    with pytest.raises(ValueError, match="recurrent state pools differ"):
        check_compatible(a, KVSide(*[getattr(a, f) for f in ("tp", "dcp", "interleave", "block_size", "attention",
                                                                "num_kv_heads", "caches")]))
    assert KVSide.from_json(a.to_json()) == a


def test_consumer_agent_refuses_a_different_tp_before_adopting():
    """``KVAgent.receive`` compares the producer's side with its own before any rank op runs: a
    hybrid producer at tp=4 cannot hand over to a tp=2 consumer, and nothing is adopted."""
    from dcpgraph.errors import RequestError
    from dcpgraph.serving.kv_connector import KVTransferConfig
    from dcpgraph.serving.kv_connector.agent import KVAgent

    class NoEngine:
        def rank_call(self, name, args):
            raise AssertionError(f"{name} ran: the refusal must come first")

    class NoFailure:
        def failure(self, transfer_id):
            return None

    cache = (("k", "k", 1, 8, "torch.float32"),)
    mine = KVSide(2, 2, 1, 4, "gqa", 1, cache, (("ssm_state_0", (4, 8, 8), "torch.float32"),))
    theirs = KVSide(4, 1, 1, 4, "gqa", 1, cache, (("ssm_state_0", (2, 8, 8), "torch.float32"),))
    agent = KVAgent.__new__(KVAgent)
    agent.engine, agent.side = NoEngine(), mine.to_json()
    agent.base = KVTransferConfig("kv_consumer", kv_rank=1)
    agent._connectors = {agent.base.kv_port: NoFailure()}  # the endpoint the params name (replica 0)
    agent.stats = {"failures": 0, "last_error": None}
    params = {"transfer_id": "t", "producer": theirs.to_json(), "prompt_token_ids": [1, 2], "output_token_ids": [3],
              "computed": 2}
    with pytest.raises(RequestError, match="same tp"):
        agent.receive([1, 2], 4, {}, params)
