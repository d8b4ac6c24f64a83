"""The compute ceiling of the paged decode kernel's fp32 path (a diagnostic for
``attention_bandwidth.py``, not a benchmark of its own).

Decode attention does, per cached token and KV head, one multiply-add per query row and element
of the key (the scores) and of the value (the weighted sum): ``rows · (d + dv)``. The kernel's
fp32 path (every CPU without AMX-BF16) does each as one lane of a vector FMA, so however fast the
memory, a token cannot take less than ``rows · (d + dv) / rate`` seconds, where ``rate`` is the
thread's multiply-add lanes per second (:func:`fma_rate`, measured by ``csrc/fma_peak.cpp``).
:func:`compute_ceiling` turns that into the KV bandwidth the kernel could reach at most: the
bytes a token stores over that time. Where it is below the read bandwidth, a read-bandwidth
target is out of reach of any fp32-FMA kernel on that CPU; the kernel's figure over this ceiling
says how much of the arithmetic it loses.
"""

from __future__ import annotations

import functools
from pathlib import Path

from dcpgraph.ops.native_build import NativeExtension

EXTENSION = NativeExtension(
    "dcpgraph_bench_fma_peak", Path(__file__).resolve().parent / "csrc" / "fma_peak.cpp",
    "fp32 FMA-rate diagnostic", "the compute-ceiling rows are left out",
)
ITERATIONS = 20_000_000  # 240 M vector FMAs: ~0.1 s at 2 a cycle and 2 GHz


@functools.cache
def fma_rate(repeats: int = 5) -> float | None:
    """The best of ``repeats`` measurements of one thread's fp32 multiply-add lanes per second
    (measured once per process); ``None`` where the extension does not build or the build has no
    vector FMA."""
    module = EXTENSION.load()
    if module is None:
        return None
    best = max(module.fma_lanes_per_second(ITERATIONS)[0] for _ in range(repeats))
    return best or None


def compute_ceiling(rate: float, rows: int, d: int, dv: int, bytes_per_token: float) -> float:
    """Bytes per second of KV the fp32 path can consume at most: a token's ``rows · (d + dv)``
    multiply-adds at ``rate`` lanes per second, per ``bytes_per_token`` bytes stored."""
    return bytes_per_token * rate / (rows * (d + dv))


def unavailable_reason() -> str | None:
    return EXTENSION.reason
