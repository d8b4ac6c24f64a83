"""Hardware descriptions: one accelerator (one rank) and the link between ranks.

Preset figures are the vendors' public per-device numbers (dense bf16, no sparsity). Link
bandwidth is *per direction*, per device, inside one node; link latency is not a datasheet
figure: it is the order of magnitude of one small collective in NCCL / HCCL within a node,
an assumption the planner states.

``compute_overlaps_memory``: GPU/NPU attention kernels stream KV while computing, so their
decode attention time is the roofline ``max(bytes / bandwidth, flops / compute)``; the CPU
kernel here computes each block after loading it, so a measured CPU uses the sum.

``attention_overhead_s`` (a fixed cost per attention call: one layer, one step) and the cache
term (a step whose working set fits in ``cache_bytes / 2`` reads it at ``cache_bandwidth``) are
measured for ``this-machine`` only; the presets leave them off (0), since a decode step's KV on
those devices is far larger than their caches and their launch cost is not a datasheet figure.
``this-machine`` is measured by :func:`~.calibration.measure_this_machine` (a short calibration
of the paged attention op, of one thread's linear and causal prefill attention in fp32 and bf16,
and of the gloo links between two processes). The prefill's rates are their own
(``linear_flops``, ``prefill_attention_flops``): on a CPU without bf16 arithmetic a bf16 linear
runs several times slower than an fp32 one while the flash attention kernel does not, and the
paged decode kernel's rate (``compute_flops``, fp32 over the cache's rows) says nothing about
either.

Between nodes. A collective whose group spans nodes runs at the inter-node link, a separate
figure: ``inter_node_bandwidth`` per direction per device and ``inter_node_latency_s`` per node
boundary it crosses (:func:`~.cost.link_for`). The default, 25 GB/s and 10 µs per hop, is a
200 Gb/s network (InfiniBand HDR or 200 GbE RoCE) with one NIC per device; a node with 400 Gb/s
NICs per device (NDR) has twice the bandwidth: pass your own :class:`Hardware` with
``dataclasses.replace(preset, inter_node_bandwidth=50e9)``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

GB = 10**9
INTER_NODE_BANDWIDTH = 25 * GB  # bytes/s per direction per device: 200 Gb/s per device
INTER_NODE_LATENCY_S = 10e-6  # per node boundary a collective crosses


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
    attention_overhead_s: float = 0.0  # per attention call (one layer, one step)
    cache_bytes: int = 0  # working sets up to half of this read at cache_bandwidth (0: no cache term)
    cache_bandwidth: float = 0.0  # bytes/s
    # measured (working set bytes, bytes/s) points, increasing in size; empty: the two-level model
    bandwidth_curve: tuple[tuple[float, float], ...] = ()
    inter_node_bandwidth: float = INTER_NODE_BANDWIDTH  # bytes/s per direction per device, between nodes
    inter_node_latency_s: float = INTER_NODE_LATENCY_S  # per node boundary crossed
    # measured (element bytes, FLOP/s) of one rank's prefill work at that dtype: its linears
    # (``x @ Wᵀ``) and its causal attention (the flash kernel); empty: compute_flops for both
    linear_flops: tuple[tuple[int, float], ...] = ()
    prefill_attention_flops: tuple[tuple[int, float], ...] = ()

    def prefill_flops(self, dtype_bytes: int) -> tuple[float, float]:
        """``(linear, attention)`` FLOP/s of a prefill in a ``dtype_bytes``-wide dtype: the measured
        entries of that width, else ``compute_flops`` (the presets' dense bf16)."""
        return (dict(self.linear_flops).get(dtype_bytes, self.compute_flops),
                dict(self.prefill_attention_flops).get(dtype_bytes, self.compute_flops))

    def read_bandwidth(self, working_set_bytes: float) -> float:
        """Bandwidth of a step that touches ``working_set_bytes``. With a measured
        ``bandwidth_curve``: interpolated linearly in ``log(size)`` between its points, its first
        point's below them and the memory bandwidth past the last. Otherwise the cache's when the
        working set fits in half of it, else the memory's."""
        curve = self.bandwidth_curve
        if curve:
            if working_set_bytes <= curve[0][0]:
                return curve[0][1]
            for (x0, b0), (x1, b1) in zip(curve, curve[1:]):
                if working_set_bytes <= x1:
                    f = math.log(working_set_bytes / x0) / math.log(x1 / x0)
                    return b0 + f * (b1 - b0)
            return self.memory_bandwidth
        if self.cache_bytes and self.cache_bandwidth and working_set_bytes <= self.cache_bytes / 2:
            return self.cache_bandwidth
        return self.memory_bandwidth


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


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GB


def nodes_spanned(group_size: int, world_size: int, per_node: int) -> int:
    """Most nodes one group spans when a world of ``world_size`` ranks, ``per_node`` to a node
    (ranks ``[n·per_node, (n+1)·per_node)`` on node ``n``), is cut into consecutive groups of
    ``group_size`` (as replicas are cut into TP groups and TP groups into DCP groups)."""
    return max(len({r // per_node for r in range(start, start + group_size)})
               for start in range(0, world_size, group_size))
