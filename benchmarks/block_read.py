"""The read ceiling of a block table (a diagnostic for ``attention_bandwidth.py``, not a
benchmark of its own: ``run.py`` lists the ones it runs).

:func:`reader` returns a callable that reads every byte of the blocks a table names, in the
table's order, with nothing else to do (``csrc/block_read.cpp``, built on first use like the
library's kernels, with the paged kernels' prefetch distance). Its bandwidth on the scattered
table is what a paged kernel can expect there at best with the same prefetch (a reference, not a
proof that no reader does better): random 4 KiB blocks defeat the hardware prefetcher at every
block, which a sequential ``x.sum()`` never pays.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dcpgraph.ops import native
from dcpgraph.ops.native_build import NativeExtension

EXTENSION = NativeExtension(
    "dcpgraph_bench_block_read", Path(__file__).resolve().parent / "csrc" / "block_read.cpp",
    "block-table read diagnostic", "the read-ceiling rows are left out",
)


def reader(tensors: list[torch.Tensor], table: torch.Tensor, blocks: int, prefetch: int | None = None):
    """A callable reading ``tensors``' blocks named by ``table[:, :blocks]``, prefetching
    ``prefetch`` blocks ahead (default: the paged kernels' distance, ``DCPGRAPH_NATIVE_PREFETCH``
    included); ``None`` where the extension does not build (the caller leaves its rows out and
    says so)."""
    prefetch = native._prefetch_blocks() if prefetch is None else prefetch
    module = EXTENSION.load()
    if module is None:
        return None
    table = table.to(torch.int32).contiguous()
    return lambda: module.read_blocks(tensors, table, blocks, prefetch)


def unavailable_reason() -> str | None:
    return EXTENSION.reason
