"""Host tensors backed by transparent huge pages, for the KV caches.

A decode step reads each layer's cache through its block table: one 16-token block of one KV
head is a few KiB, so with 4 KiB pages nearly every block read starts on a page the TLB has not
seen, and the scattered order defeats the page walker's locality. Backed by 2 MiB pages (Linux
THP, asked for with ``madvise(MADV_HUGEPAGE)``), 1 GiB of cache needs 512 TLB entries instead of
262,144. Measured on this project's 2-core Xeon (``benchmarks/attention_bandwidth.py`` with and
without ``--huge-pages``, one thread, caches read from memory through a scattered table): bf16
GQA 8:1 attention 7.7–7.8 → 8.8–9.3 GB/s, MLA 576/512 fp8 3.2–3.3 → 3.5–3.7 GB/s.

:func:`zeros` maps anonymous memory (zero-filled by the kernel), starts the tensor on a 2 MiB
boundary, advises huge pages for it, and returns a tensor over that memory (the tensor keeps the
mapping alive). The mapping is lazy: a page is committed when it is first written, so a 4 GiB cache
of which a test writes a few blocks costs a few pages of memory, not 4 GiB. Where huge pages cannot
be asked for (THP set to ``never``, ``DCPGRAPH_HUGE_PAGES=0``, no ``madvise``) the mapping is the
same without the advice; it is ``torch.zeros`` on other devices, for a tensor under 2 MiB, and where
anonymous mappings do not exist (not POSIX). :func:`status` says whether huge pages are asked for. Whether the kernel grants the pages is its decision (``AnonHugePages`` in
``/proc/meminfo`` counts what it granted); the tensor's contents are the same either way.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def status() -> str:
    """Empty when :func:`zeros` asks for huge pages; otherwise why not."""
    if os.environ.get("DCPGRAPH_HUGE_PAGES", "1") == "0":
        return "disabled by DCPGRAPH_HUGE_PAGES=0"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "this platform has no madvise(MADV_HUGEPAGE)"
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return f"{THP_SETTING} is not readable (no transparent huge pages)"
    if "[never]" in setting:
        return "transparent huge pages are set to never"
    return ""


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed tensor of ``shape`` and ``dtype`` on ``device``; on the host, lazily mapped and on
    huge pages where :func:`status` allows."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype, device=device)
    span = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE  # whole huge pages from the start
    mapping = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -_address(mapping) % HUGE_PAGE
    if not status():
        mapping.madvise(mmap.MADV_HUGEPAGE, start, span)
    raw = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=start)
    return raw.view(dtype).view(shape)


def _address(mapping: mmap.mmap) -> int:
    """Address of the mapping's first byte."""
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(mapping))
