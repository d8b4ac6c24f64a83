"""KV transfer between engines (prefill/decode disaggregation), across DCP sizes and layouts.

A prefill engine computes a prompt and exports its KV in *global token order*: for each TP rank,
each cache ``[tokens, local heads, dim]``, assembled from the DCP group that shards it (every
member of a group holds the same heads; token ``t`` is on member ``owner(t)`` at the slot the
layout gives). A decode engine with the same model and ``tp`` but any ``dcp``, interleave or
block size re-shards it with its own slot mapping and continues the request. With
``interleave == block_size`` on both sides every physical block is a contiguous run of tokens,
which is what lets a real transport move whole blocks; this in-process version gathers and
scatters token rows, so it works for any layout.

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
    layout_key: tuple  # (name, heads, dim, dtype) per cache: what must match on import
    finished: bool = False


def _layout_key(engine) -> tuple:
    return tuple((c.name, c.heads, c.dim, str(c.dtype)) for c in engine.program.caches)


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
                      tuple(exported), _layout_key(engine))


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
        )


def import_kv(engine, transfer: KVTransfer, request) -> None:
    """Write ``transfer`` into ``request``'s allocated blocks with ``engine``'s own layout."""
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
