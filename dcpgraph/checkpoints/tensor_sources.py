"""Full tensors described, not held: each rank reads only the slice of one it owns.

A source has the ``shape`` of a full state tensor and ``read(dim, start, stop)``, which returns
``full.narrow(dim, start, stop - start)`` (``dim=None``: the whole tensor) while touching only the
stored bytes that slice needs:

- :class:`Stored`: one safetensors tensor (``safe_open(...).get_slice(name)[...]``);
- :class:`Stacked` / :class:`Concatenated`: ``torch.stack`` / ``torch.cat`` of other sources
  (fused MoE experts from a checkpoint that stores one tensor per expert);
- :class:`AbsorbedMLA`: ``W_UK`` / ``W_UV^T`` of an MLA up-projection, read by whole heads;
- :class:`InMemory`: a small tensor computed from the config (rotary frequencies);
- :class:`BlockDequantized`: an fp8 weight times its per-tile scales (block-quantized checkpoints);
- :class:`Dummy`: random values from the tensor's name alone (``load_format="dummy"``).

:func:`read_local` is :meth:`dcpgraph.program.ShardRule.local` on a source: rank ``r``'s shard
under a shard rule, built from one slice per contiguous run (``packed`` rules read one per half).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..passes.absorb_mla import absorbed
from ..program import ReplicaExpertShard, ShardRule, zero_padded


class SafetensorsFiles:
    """The tensors of a model directory's safetensors file(s): names and shapes from the headers;
    each read opens the file, copies one slice out and closes it, so no mapping outlives a read."""

    def __init__(self, path: str, files: tuple[str, ...]):
        from safetensors import safe_open

        self.path = path
        self._where: dict[str, str] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for name in files:
            with safe_open(os.path.join(path, name), framework="pt") as handle:
                for key in handle.keys():
                    self._where[key] = name
                    self._shapes[key] = tuple(handle.get_slice(key).get_shape())

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return sorted(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def read(self, name: str, dim: int | None, start: int = 0, stop: int = 0) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(os.path.join(self.path, self._where[name]), framework="pt") as handle:
            if dim is None:
                piece = handle.get_tensor(name)
            else:
                piece = handle.get_slice(name)[(slice(None),) * dim + (slice(start, stop),)]
            # A private copy: a view would keep the file mapped, and every page a strided
            # (column) read touched would stay resident for as long as the rank holds the slice.
            return piece.clone()


@dataclass(frozen=True)
class Stored:
    files: SafetensorsFiles
    name: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.files.shape(self.name)

    def read(self, dim: int | None, start: int = 0, stop: int = 0) -> torch.Tensor:
        return self.files.read(self.name, dim, start, stop)

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class InMemory:
    tensor: torch.Tensor
    what: str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def read(self, dim: int | None, start: int = 0, stop: int = 0) -> torch.Tensor:
        return self.tensor if dim is None else self.tensor.narrow(dim, start, stop - start)

    def describe(self) -> str:
        return self.what


DUMMY_SEED = 1234  # vLLM's dummy-weight seed
DUMMY_RANGE = 1e-3  # vLLM's: dummy weights are uniform in [-1e-3, 1e-3]


@dataclass(frozen=True)
class Dummy:
    """A random full tensor, uniform in ``[-DUMMY_RANGE, DUMMY_RANGE]`` (float32 values), drawn
    from a generator seeded by :data:`DUMMY_SEED` and the CRC-32 of ``name``: the same values in
    every process, so every rank's slice comes from one tensor; no file is read."""

    shape: tuple[int, ...]
    name: str

    def read(self, dim: int | None, start: int = 0, stop: int = 0) -> torch.Tensor:
        import zlib

        gen = torch.Generator().manual_seed(DUMMY_SEED + zlib.crc32(self.name.encode()))
        full = (torch.rand(self.shape, generator=gen) * 2 - 1) * DUMMY_RANGE
        return full if dim is None else full.narrow(dim, start, stop - start).clone()

    def describe(self) -> str:
        return f"{self.name} (dummy)"


@dataclass(frozen=True)
class Stacked:
    """``torch.stack(parts)``: a new leading dim."""

    parts: tuple

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts), *self.parts[0].shape)

    def read(self, dim: int | None, start: int = 0, stop: int = 0) -> torch.Tensor:
        if dim is None:
            return torch.stack([p.read(None) for p in self.parts])
        if dim == 0:
            return torch.stack([p.read(None) for p in self.parts[start:stop]])
        return torch.stack([p.read(dim - 1, start, stop) for p in self.parts])

    def describe(self) -> str:
        return f"stack({self.parts[0].describe()}, ... {len(self.parts)})"


@dataclass(frozen=True)
class Concatenated:
    """``torch.cat(parts, dim)``."""

    parts: tuple
    dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        out = list(self.parts[0].shape)
        out[self.dim] = sum(p.shape[self.dim] for p in self.parts)
        return tuple(out)

    def read(self, dim: int | None, start: int = 0, stop: int = 0) -> torch.Tensor:
        if dim is None or dim != self.dim:
            return torch.cat([p.read(dim, start, stop) for p in self.parts], self.dim)
        pieces, offset = [], 0
        for part in self.parts:
            size = part.shape[dim]
            lo, hi = max(start, offset), min(stop, offset + size)
            if lo < hi:
                pieces.append(part.read(dim, lo - offset, hi - offset))
            offset += size
        return torch.cat(pieces, dim)

    def describe(self) -> str:
        return f"cat({', '.join(p.describe() for p in self.parts)})"


@dataclass(frozen=True)
class AbsorbedMLA:
    """``absorbed(up, op, nope, v, R)`` (``[H, nope, R]`` or ``[H, R, v]``); heads (dim 0) are
    read as the matching run of whole-head rows of ``up``."""

    up: object
    op: str
    nope: int
    vdim: int
    rank: int

    @property
    def shape(self) -> tuple[int, ...]:
        heads = self.up.shape[0] // (self.nope + self.vdim)
        if self.op == "mla_absorbed_uk":
            return (heads, self.nope, self.rank)
        return (heads, self.rank, self.vdim)

    def read(self, dim: int | None, start: int = 0, stop: int = 0) -> torch.Tensor:
        rows = self.nope + self.vdim
        if dim == 0:
            return absorbed(self.up.read(0, start * rows, stop * rows), self.op, self.nope, self.vdim, self.rank)
        full = absorbed(self.up.read(None), self.op, self.nope, self.vdim, self.rank)
        return full if dim is None else full.narrow(dim, start, stop - start)

    def describe(self) -> str:
        return f"{self.op}({self.up.describe()})"


@dataclass(frozen=True)
class BlockDequantized:
    """``weight · scale`` of a 2-D fp8 weight stored with one fp32 scale per ``block = (rows,
    cols)`` tile (DeepSeek-V3's format: ``<name>_scale_inv``, ``quant_method: fp8``,
    ``weight_block_size``): element ``(i, j)`` is ``float(weight[i, j]) * scale[i // rows, j //
    cols]``, computed in fp32 (the loader casts to the model's dtype). A slice reads the weight
    rows or columns it covers and the scale tiles over them."""

    weight: object
    scale: object
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def read(self, dim: int | None, start: int = 0, stop: int = 0) -> torch.Tensor:
        values = self.weight.read(dim, start, stop).to(torch.float32)
        rows, cols = self.block
        offset = [0, 0]
        if dim is None:
            scale = self.scale.read(None)
        else:
            step = self.block[dim]
            scale = self.scale.read(dim, start // step, -(-stop // step))
            offset[dim] = start % step
        tiles = scale.to(torch.float32).repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        return values * tiles[offset[0]:offset[0] + values.shape[0], offset[1]:offset[1] + values.shape[1]]

    def describe(self) -> str:
        return f"{self.weight.describe()} x {self.scale.describe()}"


def read_local(source, rule: ShardRule, rank: int, tp: int) -> torch.Tensor:
    """``rule.local(full, rank, tp)`` where ``full`` is ``source``'s tensor, reading only the slices
    rank ``rank`` keeps."""
    shape = source.shape
    if isinstance(rule, ReplicaExpertShard):  # experts partitioned over data-parallel replicas
        return source.read(0, *rule.rows(shape[0], rank))
    if rule.dim is None or tp == 1:
        return source.read(None)
    dim = rule.dim % len(shape)
    if hasattr(rule, "row_ranges"):  # sections split separately (a fused [q; k; v])
        return torch.cat([source.read(dim, start, stop) for start, stop in rule.row_ranges(rank, tp)], dim)
    packed = getattr(rule, "packed", None)
    if packed:
        half = shape[dim] // packed
        chunk = half // tp
        return torch.cat([source.read(dim, h * half + rank * chunk, h * half + (rank + 1) * chunk)
                          for h in range(packed)], dim)
    parts = rule.parts or tp
    index = rank // (tp // parts)
    if rule.padded is not None:  # rows past the source's end are the padding's zeros
        chunk = rule.padded // parts
        start, stop = min(index * chunk, shape[dim]), min((index + 1) * chunk, shape[dim])
        return zero_padded(source.read(dim, start, stop), dim, chunk)
    chunk = shape[dim] // parts
    return source.read(dim, index * chunk, (index + 1) * chunk)
