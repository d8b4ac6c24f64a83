"""Hardware descriptions: one accelerator (one rank) and the link between ranks.

Preset figures are the vendors' public per-device numbers (dense bf16, no sparsity). Link
bandwidth is *per direction*, per device, inside one node; link latency is not a datasheet
figure: it is the order of magnitude of one small collective in NCCL / HCCL within a node,
an assumption the planner states.

``compute_overlaps_memory``: GPU/NPU attention kernels stream KV while computing, so their
decode attention time is the roofline ``max(bytes / bandwidth, flops / compute)``; the CPU
kernel here computes each block after loading it, so a measured CPU uses the sum. ``this-machine``
is measured by :func:`measure_this_machine` (a short calibration of the paged attention op).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

GB = 10**9


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: int  # device memory of one rank
    memory_bandwidth: float  # bytes/s, KV and weight reads
    compute_flops: float  # attention FLOP/s (dense bf16 on accelerators; measured fp32 on CPU)
    link_bandwidth: float  # bytes/s per direction per rank
    link_latency_s: float  # per collective
    compute_overlaps_memory: bool = True
    source: str = ""


PRESETS: dict[str, Hardware] = {
    # NVIDIA H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS dense BF16, NVLink 900 GB/s
    # (bidirectional; 450 GB/s per direction).
    "h200": Hardware("h200", 141 * GB, 4.8e12, 989e12, 450e9, 10e-6,
                     source="NVIDIA H200 SXM datasheet"),
    # NVIDIA HGX B200 datasheet: 180 GB HBM3e per GPU (1.44 TB per 8), 7.7 TB/s (62 TB/s per 8),
    # FP16/BF16 36 PFLOPS with sparsity per 8 GPUs (2.25 PFLOPS dense per GPU), NVLink 5
    # 1.8 TB/s bidirectional (900 GB/s per direction).
    "b200": Hardware("b200", 180 * GB, 7.7e12, 2.25e15, 900e9, 10e-6,
                     source="NVIDIA HGX B200 datasheet"),
    # Huawei Ascend 910B (Atlas 800T A2): 64 GB HBM2e, ~1.6 TB/s, ~313 TFLOPS FP16/BF16, HCCS
    # 7 links x 56 GB/s = 392 GB/s bidirectional (196 GB/s per direction).
    "ascend-910b": Hardware("ascend-910b", 64 * GB, 1.6e12, 313e12, 196e9, 20e-6,
                            source="Huawei Atlas 800T A2 / Ascend 910B public specifications"),
    # Huawei Ascend A3 (910C, Atlas 800T A3 / CloudMatrix 384): two dies, each a device to the
    # runtime; per die 64 GB HBM, ~1.6 TB/s, ~376 TFLOPS BF16, ~196 GB/s per direction over UB/HCCS
    # (Huawei, "Serving Large Language Models on Huawei CloudMatrix384", arXiv:2506.12708).
    "ascend-a3": Hardware("ascend-a3", 64 * GB, 1.6e12, 376e12, 196e9, 20e-6,
                          source="CloudMatrix384 paper (arXiv:2506.12708), per die"),
}
MEASURED = "this-machine"
HARDWARE_NAMES = (*PRESETS, MEASURED)


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GB


def _time_op(args, reps: int) -> float:
    import torch

    op = torch.ops.dcpgraph.paged_attention
    op(*args)
    best = float("inf")
    for _ in range(reps):
        start = time.thread_time()
        op(*args)
        best = min(best, time.thread_time() - start)
    return best


def _attention_args(tokens: int, q_heads: int, dim: int, block: int = 16):
    import torch

    import dcpgraph.ops.library  # noqa: F401  (registers torch.ops.dcpgraph)

    blocks = -(-tokens // block)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(blocks, block, 1, dim, generator=g)
    v = torch.randn(blocks, block, 1, dim, generator=g)
    q = torch.randn(1, q_heads, dim, generator=g)
    table = torch.arange(blocks, dtype=torch.int32).view(1, -1)
    return (q, k, v, table, torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([tokens], dtype=torch.int32), None, dim ** -0.5)


def calibrate_attention(tokens: int = 1 << 17, dim: int = 128, heads: tuple[int, int] = (1, 16),
                        reps: int = 5) -> tuple[float, float, dict]:
    """Effective read bandwidth and compute rate of ``paged_attention`` on this CPU (fp32, one
    KV head, one thread of CPU time, best of ``reps``).

    Two runs over the same ``tokens`` of KV (``tokens·2·dim·4`` bytes), one with ``heads[0]``
    query heads and one with ``heads[1]``: same bytes, FLOPs ``4·tokens·dim`` per head. With
    ``t = bytes / bw + flops / rate`` for both, the two equations give ``bw`` and ``rate``.
    """
    kv_bytes = tokens * 2 * dim * 4
    times = {h: _time_op(_attention_args(tokens, h, dim), reps) for h in heads}
    (h1, t1), (h2, t2) = times.items()
    flop_per_head = 4 * tokens * dim
    rate = (h2 - h1) * flop_per_head / max(t2 - t1, 1e-9)
    memory_s = max(t1 - h1 * flop_per_head / rate, 1e-9)
    return kv_bytes / memory_s, rate, {"kv_bytes": kv_bytes, "seconds_by_heads": times}


def measure_this_machine(**calibration) -> Hardware:
    """This machine as one rank: physical memory, and the attention bandwidth / compute rate from
    :func:`calibrate_attention` (about a second). Ranks are gloo processes on localhost; the link
    figures are loopback assumptions (not measured): 5 GB/s, 200 µs per collective."""
    bw, rate, _ = calibrate_attention(**calibration)
    return Hardware(MEASURED, _physical_memory(), bw, rate, 5e9, 200e-6, compute_overlaps_memory=False,
                    source="measured: paged_attention calibration on this CPU")


def get_hardware(name: str, **overrides) -> Hardware:
    """A preset by name, or ``this-machine`` (measured); ``overrides`` replace fields."""
    key = name.strip().lower()
    if key == MEASURED:
        hw = measure_this_machine()
    elif key in PRESETS:
        hw = PRESETS[key]
    else:
        raise ValueError(f"unknown hardware {name!r}; choose from {list(HARDWARE_NAMES)}")
    return replace(hw, **overrides) if overrides else hw
