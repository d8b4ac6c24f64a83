"""KV transfer between engines (prefill/decode disaggregation), across DCP sizes and layouts.

A prefill engine computes a prompt and exports its KV in *global token order*: for each TP rank,
each cache ``[tokens, local heads, dim]``, assembled from the DCP group that shards it (every
member of a group holds the same heads; token ``t`` is on member ``owner(t)`` at the slot the
layout gives). A decode engine with the same model and ``tp`` but any ``dcp``, interleave or
block size re-shards it with its own slot mapping and continues the request. With
``interleave == block_size`` on both sides every physical block is a contiguous run of tokens,
which is what lets a real transport move whole blocks; this in-process version gathers and
scatters token rows, so it works for any layout.

A hybrid model's recurrent layers keep a fixed-size state per request instead of KV: every
layer's conv and recurrent/SSM state in the request's slot. It is split over TP by heads and is the
same on every member of a DCP group, so it travels per TP rank (rank ``i``'s state goes to rank
``i`` of an engine with the same ``tp``, whatever either side's ``dcp``), copied out of the
producer's slot after the prefill and into the slot the consumer gives the request at adoption.

Both engines must hold all their ranks in this process (the emulated executor). Between
processes (serving instances with any tp and dcp), :mod:`dcpgraph.serving.kv_connector` moves each
consumer rank's rows straight from the producer rank that holds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import layout
from ..errors import RequestError


@dataclass(frozen=True)
class KVTransfer:
    """A request's KV, ready to continue elsewhere: ``tokens[:computed]`` are cached.

    ``finished``: the request already ended at ``tokens[prompt_len:]`` (its first token was an EOS
    id); then ``computed == 0`` and ``caches`` is empty, and there is nothing to continue."""

    tokens: tuple[int, ...]
    computed: int
    prompt_len: int
    tp: int
    caches: tuple[dict[str, torch.Tensor], ...]  # per TP rank: cache name -> [computed, heads, dim]
    layout_key: tuple  # (name, heads, dim, dtype) per cache, (name, shape, dtype) per state pool
    finished: bool = False
    # per TP rank: state pool name -> the request's slot [*shape] (hybrid models; empty otherwise)
    states: tuple[dict[str, torch.Tensor], ...] = ()


def _layout_key(engine) -> tuple:
    program = engine.program
    return (tuple((c.name, c.heads, c.dim, str(c.dtype)) for c in program.caches)
            + tuple((p.name, tuple(p.shape), str(p.dtype)) for p in program.recurrent_states))


def _export_states(engine, caches: dict[int, dict[str, torch.Tensor]], slot: int | None) -> tuple:
    """Each rank's copy of every recurrent state pool's slot ``slot`` (nothing without pools)."""
    pools = engine.program.recurrent_states
    if not pools:
        return ()
    if slot is None:
        raise RequestError("the request holds no recurrent-state slot: its state cannot be exported")
    return tuple({p.name: caches[rank][p.name][slot].clone() for p in pools} for rank in engine.mesh.ranks)


def _emulated_caches(engine) -> dict[int, dict[str, torch.Tensor]]:
    """Every rank's caches, by rank; only an executor that holds all ranks in this process has them."""
    executor, ranks = engine.executor, tuple(engine.mesh.ranks)
    if engine.program.lowering.sliding_caches:
        raise RequestError("KV transfer is not supported with hybrid_kv_cache=True (the sliding layers "
                           "keep only their window, in their own block table)")
    compressed = sorted({c.layer for c in engine.program.caches if c.tokens_per_row != 1})
    if compressed:
        raise RequestError(f"KV transfer is not supported with DeepSeek-V4 compressed attention (layers "
                           f"{compressed}): its entry caches hold one row per compressed entry and its open "
                           "windows are not exported")
    if tuple(executor.local_ranks) != ranks:
        raise RequestError(
            f"KV transfer needs every rank's cache in this process (the emulated executor); the "
            f"{executor.mode} executor holds ranks {list(executor.local_ranks)} of {list(ranks)}"
        )
    return {rank: executor.rank_caches(rank) for rank in ranks}


def _slots(engine, positions: torch.Tensor, table: list[int], rank: int) -> torch.Tensor:
    mesh = engine.mesh
    rows = torch.tensor(table, dtype=torch.int64).expand(len(positions), -1)
    return layout.slot_mapping(positions, rows, mesh.dcp_rank(rank), mesh.dcp, engine.block_size, engine.interleave)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as its bytes (aten's CPU index ops have no fp8 kernels); others unchanged."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def export_kv(engine, request) -> KVTransfer:
    """The KV of ``request``'s first ``computed`` tokens, per TP rank, in global token order."""
    caches = _emulated_caches(engine)
    mesh = engine.mesh
    table = engine.blocks.table(request.id)
    positions = torch.arange(request.computed)
    owners = layout.owner(positions, mesh.dcp, engine.interleave)
    exported = []
    for rank in mesh.ranks:
        group = mesh.dcp_group(rank)
        full = {}
        for spec in engine.program.caches:
            out = _bits(torch.empty(request.computed, spec.heads, spec.dim, dtype=spec.dtype))
            for d, member in enumerate(group):
                mine = owners == d
                slots = _slots(engine, positions, table, member)[mine]
                flat = _bits(caches[member][spec.name]).view(-1, spec.heads, spec.dim)
                out[mine] = flat.index_select(0, slots)
            full[spec.name] = out.view(spec.dtype)
        exported.append(full)
    return KVTransfer(tuple(request.tokens), request.computed, len(request.prompt), mesh.tp,
                      tuple(exported), _layout_key(engine),
                      states=_export_states(engine, caches, request.state_slot))


def check_exportable(engine) -> None:
    """Refuse, before any step runs, an engine whose executor cannot read every rank's cache."""
    _emulated_caches(engine)


def finished_transfer(engine, request) -> KVTransfer:
    """The transfer of a request that ended at its first token: its tokens, no KV."""
    return KVTransfer(tuple(request.tokens), 0, len(request.prompt), engine.mesh.tp, (), _layout_key(engine),
                      finished=True)


def check_transfer(engine, transfer: KVTransfer) -> None:
    """Refuse, before anything changes, a transfer this engine cannot take."""
    _emulated_caches(engine)
    if transfer.tp != engine.mesh.tp or transfer.layout_key != _layout_key(engine):
        raise RequestError(
            "KV transfer needs the same model and tp on both sides "
            f"(exported tp={transfer.tp}, caches {transfer.layout_key}; "
            f"importing tp={engine.mesh.tp}, caches {_layout_key(engine)})"
            + ("; a hybrid model's recurrent state is split over tp by heads and moves rank to rank, so "
               "the two tp must be equal" if engine.program.recurrent_states else "")
        )
    if len(transfer.states) != (engine.mesh.tp if engine.program.recurrent_states else 0):
        raise RequestError(f"the transfer carries recurrent state for {len(transfer.states)} rank(s); this engine "
                           f"needs it for {engine.mesh.tp if engine.program.recurrent_states else 0}")


def import_kv(engine, transfer: KVTransfer, request) -> None:
    """Write ``transfer`` into ``request``'s allocated blocks with ``engine``'s own layout, and
    its recurrent state (if any) into ``request``'s state slot on every rank."""
    check_transfer(engine, transfer)
    caches = _emulated_caches(engine)
    table = engine.blocks.table(request.id)
    positions = torch.arange(transfer.computed)
    for rank in engine.mesh.ranks:
        slots = _slots(engine, positions, table, rank)
        owned = slots >= 0
        for spec in engine.program.caches:
            flat = _bits(caches[rank][spec.name]).view(-1, spec.heads, spec.dim)
            flat.index_copy_(0, slots[owned], _bits(transfer.caches[rank][spec.name])[owned])
    for rank, states in zip(engine.mesh.ranks, transfer.states):  # none without recurrent layers
        for name, state in states.items():
            caches[rank][name][request.state_slot].copy_(state)
