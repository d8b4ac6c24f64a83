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

DeepSeek-V4's compressed layers add caches of one row per compressed entry (the entries and
CSA's indexer keys): they travel in *entry order*, ``[computed // m, 1, dim]``, gathered from the
producer's owners and scattered by the consumer's own placement
(:mod:`dcpgraph.runtime.entry_placement`: the interleave rule on entry indices at ``dcp > 1``).
Their open windows are recurrent state pools and travel as a hybrid's state does.

When every cache and state pool is whole on every rank (replicated over TP: MLA's latent, a
single KV head as V4's, V4's open windows), every rank's copy is the same and the two sides may
have different ``tp``: each consumer rank takes the producer's first copy.

Both engines must hold all their ranks in this process (the emulated executor). Between
processes (serving instances with any tp and dcp), :mod:`dcpgraph.serving.kv_connector` moves each
consumer rank's rows straight from the producer rank that holds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import layout
from ..errors import RequestError
from .entry_placement import entry_slots, is_entry_cache

REPLICATED_STATE_ROLES = frozenset({"open_window"})  # V4's compressor windows: the same on every rank


@dataclass(frozen=True)
class KVTransfer:
    """A request's KV, ready to continue elsewhere: ``tokens[:computed]`` are cached.

    ``finished``: the request already ended at ``tokens[prompt_len:]`` (its first token was an EOS
    id); then ``computed == 0`` and ``caches`` is empty, and there is nothing to continue."""

    tokens: tuple[int, ...]
    computed: int
    prompt_len: int
    tp: int
    # per TP rank: cache name -> [computed, heads, dim] (token order); an entry cache -> [computed // m, 1, dim]
    caches: tuple[dict[str, torch.Tensor], ...]
    layout_key: tuple  # (name, heads, dim, dtype) per cache, (name, shape, dtype) per state pool
    finished: bool = False
    # per TP rank: state pool name -> the request's slot [*shape] (hybrid models, V4's open windows; else empty)
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
    if tuple(executor.local_ranks) != ranks:
        raise RequestError(
            f"KV transfer needs every rank's cache in this process (the emulated executor); the "
            f"{executor.mode} executor holds ranks {list(executor.local_ranks)} of {list(ranks)}"
        )
    return {rank: executor.rank_caches(rank) for rank in ranks}


def _rows(engine, spec, computed: int) -> torch.Tensor:
    """The global indices a cache holds for ``computed`` tokens: its tokens, or for an entry cache
    its closed entries ``[0, computed // m)``."""
    if is_entry_cache(spec):
        return torch.arange(computed // int(engine.program.facts.extra["compress_rates"][spec.layer]))
    return torch.arange(computed)


def _slots(engine, spec, rows: torch.Tensor, table: list[int], rank: int) -> torch.Tensor:
    """Slots of ``rows`` (token positions, or entry indices of an entry cache) on ``rank``; −1 where
    its DCP rank does not hold them."""
    mesh = engine.mesh
    if is_entry_cache(spec):
        return entry_slots(table, rows, rate=int(engine.program.facts.extra["compress_rates"][spec.layer]),
                           tokens_per_row=spec.tokens_per_row, block_size=engine.block_size, dcp=mesh.dcp,
                           dcp_rank=mesh.dcp_rank(rank), interleave=engine.interleave)
    table_rows = torch.tensor(table, dtype=torch.int64).expand(len(rows), -1)
    return layout.slot_mapping(rows, table_rows, mesh.dcp_rank(rank), mesh.dcp, engine.block_size, engine.interleave)


def whole_on_every_rank(program) -> bool:
    """Whether every cache and state pool of ``program`` is the same on every rank (replicated over
    TP): MLA's latent or a single KV head, and only state pools of :data:`REPLICATED_STATE_ROLES`."""
    facts = program.facts
    total = 1 if facts.attention == "mla" else int(facts.num_kv_heads)
    return (not facts.layer_kv_heads and all(c.heads == total for c in program.caches)
            and all(p.role in REPLICATED_STATE_ROLES for p in program.recurrent_states))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as its bytes (aten's CPU index ops have no fp8 kernels); others unchanged."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def export_kv(engine, request) -> KVTransfer:
    """The KV of ``request``'s first ``computed`` tokens, per TP rank, in global token order."""
    caches = _emulated_caches(engine)
    mesh = engine.mesh
    table = engine.blocks.table(request.id)
    exported = []
    for rank in mesh.ranks:
        group = mesh.dcp_group(rank)
        full = {}
        for spec in engine.program.caches:
            rows = _rows(engine, spec, request.computed)
            owners = layout.owner(rows, mesh.dcp, engine.interleave)  # token or entry index: one rule
            out = _bits(torch.empty(len(rows), spec.heads, spec.dim, dtype=spec.dtype))
            for d, member in enumerate(group):
                mine = owners == d
                slots = _slots(engine, spec, rows, table, member)[mine]
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
    whole = whole_on_every_rank(engine.program)
    split_states = any(p.role not in REPLICATED_STATE_ROLES for p in engine.program.recurrent_states)
    if transfer.layout_key != _layout_key(engine) or (transfer.tp != engine.mesh.tp and not whole):
        raise RequestError(
            "KV transfer needs the same model and tp on both sides "
            f"(exported tp={transfer.tp}, caches {transfer.layout_key}; "
            f"importing tp={engine.mesh.tp}, caches {_layout_key(engine)})"
            + ("; a hybrid model's recurrent state is split over tp by heads and moves rank to rank, so "
               "the two tp must be equal" if split_states else "")
            + ("; tp may differ only where every cache and state is whole on every rank "
               "(MLA's latent, a single KV head, DeepSeek-V4)" if transfer.tp != engine.mesh.tp and not whole else "")
        )
    if len(transfer.states) != (transfer.tp if engine.program.recurrent_states else 0):
        raise RequestError(f"the transfer carries recurrent state for {len(transfer.states)} rank(s); this engine "
                           f"needs it for {transfer.tp if engine.program.recurrent_states else 0}")


def import_kv(engine, transfer: KVTransfer, request) -> None:
    """Write ``transfer`` into ``request``'s allocated blocks with ``engine``'s own layout, and
    its recurrent state (if any) into ``request``'s state slot on every rank. Rank ``i`` takes the
    producer's rank ``i`` copy, or its first where the two ``tp`` differ (every copy the same)."""
    check_transfer(engine, transfer)
    caches = _emulated_caches(engine)
    table = engine.blocks.table(request.id)
    for i, rank in enumerate(engine.mesh.ranks):
        source = i if transfer.tp == engine.mesh.tp else 0
        for spec in engine.program.caches:
            rows = _rows(engine, spec, transfer.computed)
            slots = _slots(engine, spec, rows, table, rank)
            owned = slots >= 0
            flat = _bits(caches[rank][spec.name]).view(-1, spec.heads, spec.dim)
            flat.index_copy_(0, slots[owned], _bits(transfer.caches[source][spec.name])[owned])
        if transfer.states:  # none without recurrent layers
            for name, state in transfer.states[source].items():
                caches[rank][name][request.state_slot].copy_(state)
