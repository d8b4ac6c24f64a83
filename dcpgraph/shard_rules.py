"""How a state tensor of a :class:`~dcpgraph.program.Program` is split over the tensor-parallel
ranks: :class:`ShardRule` (replicated, or ``tp`` equal slices along one dim, zero-padded where
``tp`` does not divide it), :class:`ReplicaExpertShard` (routed experts over every rank of
data-parallel replicas) and :class:`RowSections` (a fused weight: each section of rows sharded by
its own rule, the rank's pieces stacked). Each rule maps a full tensor to rank ``r``'s slice
(``local``) and a full shape to the slice's shape (``local_shape``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardRule:
    """How rank ``r`` of a TP group of ``tp`` gets its piece of a full tensor.

    ``dim=None`` replicates. Otherwise the tensor is split into ``tp`` equal chunks along ``dim``
    (``chunks = tp``), or, for KV heads replicated over ``tp // n_kv`` ranks, into ``parts`` chunks
    of which rank ``r`` takes chunk ``r // (tp // parts)``. With ``padded`` (a multiple of the
    chunk count), ``dim`` is first extended with zeros to ``padded`` entries: rank ``r`` holds
    entries ``[r·c, (r+1)·c)`` of the padded tensor, ``c = padded / parts``, so the last ranks'
    chunks end in zero rows (a vocabulary that ``tp`` does not divide).
    """

    dim: int | None = None
    parts: int | None = None  # None: one part per rank
    padded: int | None = None  # None: dim is split as it is

    def local(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        if self.dim is None or tp == 1:
            return full
        parts = self.parts or tp
        if self.padded is not None:
            full = zero_padded(full, self.dim, self.padded)
        if full.shape[self.dim] % parts:
            raise ValueError(f"cannot split dim {self.dim} of {tuple(full.shape)} into {parts}")
        index = rank // (tp // parts)
        return full.chunk(parts, self.dim)[index].contiguous()

    def local_shape(self, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
        if self.dim is None or tp == 1:
            return tuple(shape)
        out = list(shape)
        if self.padded is not None:
            out[self.dim] = self.padded
        out[self.dim] //= self.parts or tp
        return tuple(out)


def zero_padded(full: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``full`` extended along ``dim`` with zeros to ``size`` entries (``size >= full.shape[dim]``)."""
    missing = size - full.shape[dim]
    if missing < 0:
        raise ValueError(f"cannot pad dim {dim} of {tuple(full.shape)} down to {size}")
    if missing == 0:
        return full
    shape = list(full.shape)
    shape[dim] = missing
    return torch.cat([full, full.new_zeros(shape)], dim)


REPLICATE = ShardRule()


@dataclass(frozen=True)
class ReplicaExpertShard(ShardRule):
    """Rank ``t`` of replica ``replica`` holds chunk ``replica·(parts/replicas) + t`` of dim 0 cut
    into ``parts = replicas·tp`` chunks (its experts in the EP group)."""

    replicas: int = 1
    replica: int = 0

    def local(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        if full.shape[0] % self.parts:
            raise ValueError(f"cannot split dim 0 of {tuple(full.shape)} into {self.parts}")
        start, stop = self.rows(full.shape[0], rank)
        return full[start:stop].contiguous()

    def local_shape(self, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
        return (shape[0] // self.parts, *shape[1:])

    def rows(self, total: int, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of dim 0 that rank ``rank`` of this replica holds, of ``total``."""
        chunk = total // self.parts
        index = self.replica * (self.parts // self.replicas) + rank
        return index * chunk, (index + 1) * chunk


def section_ranges(rule: ShardRule, rows: int, rank: int, tp: int) -> list[tuple[int, int]] | None:
    """The ``[start, stop)`` rows of a ``rows``-row tensor that ``rule`` keeps on rank ``rank`` of
    ``tp``, in order, for a rule that replicates or splits that tensor's dim 0 (the caller checks
    that ``rule.dim`` is dim 0 of its tensor): a plain, head-section (``row_ranges``) or packed
    rule; None for any other (a padded or expert rule)."""
    if rule.dim is None or tp == 1:
        return [(0, rows)]
    if rule.padded is not None:
        return None
    if hasattr(rule, "row_ranges"):
        return list(rule.row_ranges(rank, tp))
    packed = getattr(rule, "packed", None)
    if packed:
        half = rows // packed
        chunk = half // tp
        return [(h * half + rank * chunk, h * half + (rank + 1) * chunk) for h in range(packed)]
    if type(rule) is not ShardRule:
        return None
    parts = rule.parts or tp
    chunk, index = rows // parts, rank // (tp // parts)
    return [(index * chunk, (index + 1) * chunk)]


@dataclass(frozen=True)
class RowSections(ShardRule):
    """Dim 0 of a tensor stacked from sections (``sections``: each one's rows and own rule, which
    splits or replicates its dim 0): rank ``r`` keeps, section after section, the rows that
    section's rule gives it, so its piece is the concatenation of the sections' own local pieces
    (:func:`section_ranges`)."""

    dim: int | None = 0
    sections: tuple[tuple[int, ShardRule], ...] = ()

    def row_ranges(self, rank: int, tp: int) -> list[tuple[int, int]]:
        """The ``[start, stop)`` rows of the full tensor that rank ``rank`` keeps, in order."""
        out, offset = [], 0
        for rows, rule in self.sections:
            ranges = section_ranges(rule, rows, rank, tp)
            if ranges is None:
                raise ValueError(f"{rule} does not split dim 0 by rows")
            out.extend((offset + a, offset + b) for a, b in ranges)
            offset += rows
        return out

    def local(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        if tp == 1:
            return full
        if full.shape[0] != sum(rows for rows, _ in self.sections):
            raise ValueError(f"dim 0 of {tuple(full.shape)} is not the sections' {[r for r, _ in self.sections]}")
        return torch.cat([full[a:b] for a, b in self.row_ranges(rank, tp)], 0).contiguous()

    def local_shape(self, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
        if tp == 1:
            return tuple(shape)
        return (sum(b - a for a, b in self.row_ranges(0, tp)), *shape[1:])
