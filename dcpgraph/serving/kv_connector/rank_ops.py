"""The steps of a transfer beside the engine, registered as rank ops ``kv.<step>``
(:class:`~dcpgraph.runtime.engine_client.RankOp`, run by ``EngineClient.rank_call``).

Driver halves, run once where the scheduler is: ``side`` (this instance's layout), ``hold`` or
``release`` a prefilled request's blocks, ``adopt`` a transferred request, and for ``send``/``recv``
the request's block table. Rank halves, run on every rank at once: gather and send (producer) or
receive and scatter (consumer) that rank's rows. Arguments and results are plain data, so the same
call runs in process (``tp == 1``) or across a :class:`~dcpgraph.serving.workers.RemoteEngine`'s
workers.

``DCPGRAPH_KV_FAULT`` (tests only) makes a rank exit at a chosen point: ``producer_exit_before_send``
(the producer dies after accepting the request) or ``consumer_exit_mid_transfer`` (the consumer
dies once the transfer group is up, before any KV arrived).
"""

from __future__ import annotations

import os

import torch

from ...errors import KVTransferError
from ...runtime.engine_client import RankState, register_rank_op
from .config import parse_kv_transfer_config
from .plan import (
    KVSide,
    block_mode,
    buffer_bytes,
    check_compatible,
    gather,
    pack_states,
    scatter,
    state_source,
    transfer_plan,
    unpack_states,
)

FAULT_ENV = "DCPGRAPH_KV_FAULT"


def _fault(name: str) -> bool:
    return os.environ.get(FAULT_ENV) == name


def _one_rank_per_process(engine) -> None:
    ranks = tuple(engine.executor.local_ranks)
    if len(ranks) != 1:
        raise KVTransferError(f"a cross-process KV transfer needs one rank per process (tp=1, or a worker of the "
                              f"distributed executor); the {engine.executor.mode} executor holds ranks {list(ranks)}")


def _caches(state: RankState) -> list:
    return [state.caches[c.name] for c in state.program.caches]


# -- driver halves: they read or change the schedule, once ----------------------------------------
def side(engine) -> dict:
    return KVSide.of_engine(engine).to_json()


def hold(engine, rid: int) -> dict:
    tokens, computed, prompt_len = engine.hold_for_transfer(rid)
    return {"tokens": tokens, "computed": computed, "prompt_len": prompt_len}


def release(engine, rid: int) -> bool:
    return engine.release_held(rid)


def adopt(engine, prompt: list[int], output: list[int], max_new_tokens: int, sampling: dict) -> dict:
    rid, start = engine.adopt_transferred(prompt, output, max_new_tokens, **sampling)
    return {"rid": rid, "start": start}


def _state_slot(engine, rid: int) -> int | None:
    """The request's recurrent-state slot: kept for a held request (producer), taken at adoption
    (consumer); ``None`` for a model without recurrent layers."""
    held = engine.scheduler.held_state_slot(rid)
    if held is not None:
        return held
    request = engine.scheduler.get(rid)
    return None if request is None else request.state_slot


def _moving(engine, rid: int, **args) -> dict:
    """The driver half of ``send`` and ``recv``: the request's block table, its state slot and this
    instance's side, for every rank's half."""
    _one_rank_per_process(engine)
    slot = _state_slot(engine, rid)
    if engine.program.recurrent_states and slot is None:
        raise KVTransferError(f"request {rid} holds no recurrent-state slot: its state cannot move")
    return {"table": list(engine.blocks.table(rid)), "state_slot": slot, "side": side(engine), **args}


def _plan(mine_json: dict, other: dict, producer_side: bool, start: int, end: int):
    mine, peer = KVSide.from_json(mine_json), KVSide.from_json(other)
    producer, consumer = (mine, peer) if producer_side else (peer, mine)
    try:
        check_compatible(producer, consumer)
    except ValueError as err:
        raise KVTransferError(f"KV transfer refused: {err}") from None
    return mine, peer, transfer_plan(producer, consumer, start, end), block_mode(producer, consumer)


# -- rank halves: each rank moves its own rows --------------------------------------------------------
def send_rows(state: RankState, table: list[int], state_slot: int | None, side: dict, transfer_id: str,
              consumer: dict, start: int, end: int, config: dict) -> int:
    """Producer rank: send every consumer rank its rows of ``[start, end)`` (and V4's entries of
    them) and the consumer ranks whose :func:`~.plan.state_source` it is this rank's recurrent state
    (hybrid models, V4's open windows); returns bytes sent."""
    rank = state.rank
    mine, peer, plans, blocks = _plan(side, consumer, True, start, end)
    caches = _caches(state)
    sends = {mine.ranks + p.dst: gather(mine, rank, caches, table, p, peer, blocks) for p in plans if p.src == rank}
    if mine.states:
        packed = pack_states(mine, state.caches, state_slot)
        for dst in range(peer.ranks):
            if state_source(mine, peer, dst) == rank:
                twin = mine.ranks + dst
                sends[twin] = torch.cat([sends[twin], packed]) if twin in sends else packed
    if _fault("producer_exit_before_send"):
        os._exit(17)
    parse_kv_transfer_config(config).connector().exchange(transfer_id, rank, mine.ranks + peer.ranks, sends, {})
    return sum(len(b) for b in sends.values())


def recv_rows(state: RankState, table: list[int], state_slot: int | None, side: dict, transfer_id: str,
              producer: dict, start: int, end: int, config: dict) -> int:
    """Consumer rank: receive this rank's rows of ``[start, end)`` (and V4's entries of them) into
    the request's blocks and the recurrent state of its :func:`~.plan.state_source` rank into its
    slot; returns bytes."""
    rank = state.rank
    mine, peer, plans, blocks = _plan(side, producer, False, start, end)
    mine_plans = [p for p in plans if p.dst == rank]
    kv_sizes = {p.src: buffer_bytes(mine, rank, p, peer, p.src, blocks) for p in mine_plans}
    sizes = dict(kv_sizes)
    source = state_source(peer, mine, rank)
    if mine.states:
        sizes[source] = sizes.get(source, 0) + mine.state_bytes
    connector = parse_kv_transfer_config(config).connector()
    if _fault("consumer_exit_mid_transfer"):  # the group is up, the producer is sending: die
        connector.join_group(transfer_id, peer.ranks + rank, mine.ranks + peer.ranks)
        os._exit(17)
    received = connector.exchange(transfer_id, peer.ranks + rank, mine.ranks + peer.ranks, {}, sizes)
    caches = _caches(state)
    for p in mine_plans:
        scatter(mine, rank, caches, table, p, peer, blocks, received[p.src][: kv_sizes[p.src]])
    if mine.states:
        unpack_states(mine, state.caches, state_slot, received[source][kv_sizes.get(source, 0) :])
    return sum(sizes.values())


OPS = {"side": (side, None), "hold": (hold, None), "release": (release, None), "adopt": (adopt, None),
       "send": (_moving, send_rows), "recv": (_moving, recv_rows)}
PREFIX = "kv."  # their names among an engine's rank ops


def op_name(fn: str) -> str:
    """The rank-op name of KV transfer step ``fn``; an unknown step is refused naming the known ones."""
    if fn not in OPS:
        raise ValueError(f"unknown KV transfer op {fn!r}; known: {sorted(OPS)}")
    return PREFIX + fn


for _name, (_driver, _on_rank) in OPS.items():
    register_rank_op(PREFIX + _name, _driver, _on_rank)
