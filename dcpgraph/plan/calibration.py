"""Measuring ``this-machine``: the attention op's cost terms, the prefill's rates per dtype
(:func:`calibrate_prefill`: a linear and causal flash attention) and the gloo links between ranks.

Attention (:func:`calibrate_attention`, ``paged_attention`` on one thread, fp32, one KV head,
best of ``reps`` thread-CPU times; calls under a millisecond take the best of at least
:data:`SMALL_REPS`, since on a shared virtual machine a call that the hypervisor pauses is charged
milliseconds of "thread" time, which no statistic of a few small calls survives) is modelled as

    t = overhead + bytes / bw(working set) + flops / rate,

where ``bw`` is the cache bandwidth when the working set fits in half the core's private cache
(the rest holds queries, outputs and everything else the step touches) and the memory bandwidth
otherwise. Four timings give the four figures:

1. ``tokens`` (128K) of KV with ``heads[0]`` and ``heads[1]`` query heads: same bytes, FLOPs
   ``4·tokens·dim`` per head, so the two equations give ``bw`` (memory) and ``rate``;
2. one block (16 tokens), one head: what is left after bytes and FLOPs is the per-call overhead;
3. a KV of half the cache, one head, called repeatedly (so it is resident): the cache
   bandwidth, after the overhead and FLOPs are taken out (never less than the memory's);
4. KVs of :data:`CURVE_BYTES` (1 to 64 MiB), one head each, two distinct buffers of each size read
   in turn (a decode step reads the other layers' KV before this one's again, so a point's reuse
   distance is twice its size, not its size): the bandwidth curve
   ``bw(working set)`` between the private cache and memory, interpolated by
   :meth:`Hardware.read_bandwidth`. Shared last-level caches (several, of sizes a virtual machine
   does not report truthfully: this one claims 480 MiB of L3) decide where the curve falls, so it
   is measured, not derived from sysfs.

The cache size is the machine's own (sysfs: the largest cache private to cpu0, its L2 here), not a
constant. Links (:func:`measure_links`, inside a gloo world): per collective, a call's time is
the best mean over bursts of back-to-back calls; a one-element call's is the latency, and a
1 MiB-per-peer call's, less that latency, gives the bandwidth from the bytes each rank sends,
``(N−1)·chunk``, as :mod:`.cost` counts them.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, replace
from functools import partial

import dcpgraph.ops.library  # noqa: F401  (registers torch.ops.dcpgraph)

from ..runtime import host_collectives
from ..runtime.distributed import spawn
from .hardware import HARDWARE_NAMES, MEASURED, PRESETS, Hardware, physical_memory

LINK_CHUNK_BYTES = 1 << 20
LINK_BURST = 8  # back-to-back calls per timing in measure_links
CURVE_BYTES = (1 << 20, 4 << 20, 16 << 20, 64 << 20)
CURVE_BUFFERS = 2  # a decode step reads other layers' KV before it reads this one again
SMALL_REPS = 50


@dataclass(frozen=True)
class AttentionCalibration:
    bandwidth: float  # bytes/s from memory
    compute_flops: float
    overhead_s: float  # per call
    cache_bytes: int
    cache_bandwidth: float  # bytes/s of a cache-resident KV
    seconds: dict  # the raw timings, by what was timed
    bandwidth_curve: tuple = ()  # (working set bytes, bytes/s), increasing in size


def private_cache_bytes(cpu: int = 0) -> int:
    """The largest data/unified cache that ``cpu`` does not share with another CPU (sysfs); 0 when
    the platform does not say."""
    root = f"/sys/devices/system/cpu/cpu{cpu}/cache"
    best = 0
    try:
        entries = sorted(e for e in os.listdir(root) if e.startswith("index"))
    except OSError:
        return 0
    for entry in entries:
        def read(name: str, entry=entry) -> str:
            with open(os.path.join(root, entry, name)) as f:
                return f.read().strip()
        try:
            kind, size, shared = read("type"), read("size"), read("shared_cpu_list")
        except OSError:
            continue
        if kind == "Instruction" or shared != str(cpu):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1], 1)
        best = max(best, int(size.rstrip("KM")) * scale)
    return best


def _time_op(args, reps: int, *more_args) -> float:
    """Best thread time of one ``paged_attention`` call over ``reps`` rounds; with ``more_args``
    each round calls every argument set in turn (each timed), so a KV is re-read only after the
    others: its reuse distance is the sum of their sizes, not its own."""
    import torch

    op = torch.ops.dcpgraph.paged_attention
    sets = (args, *more_args)
    for a in sets:
        op(*a)
    best = float("inf")
    for _ in range(reps):
        for a in sets:
            start = time.thread_time()
            op(*a)
            best = min(best, time.thread_time() - start)
    return best


def attention_args(tokens: int, q_heads: int, dim: int, block: int = 16):
    """``paged_attention`` arguments over ``tokens`` of one fp32 KV head (one request)."""
    import torch


    blocks = -(-tokens // block)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(blocks, block, 1, dim, generator=g)
    v = torch.randn(blocks, block, 1, dim, generator=g)
    q = torch.randn(1, q_heads, dim, generator=g)
    table = torch.arange(blocks, dtype=torch.int32).view(1, -1)
    return (q, k, v, table, torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([tokens], dtype=torch.int32), None, dim ** -0.5)


def calibrate_attention(tokens: int = 1 << 17, dim: int = 128, heads: tuple[int, int] = (1, 16),
                        reps: int = 5, cache_bytes: int | None = None) -> AttentionCalibration:
    """The module docstring's four figures for this CPU (a second or two)."""
    per_token = 2 * dim * 4

    def flops(n: int, h: int) -> float:
        return 4.0 * n * dim * h

    seconds = {f"{tokens} tokens, {h} heads": _time_op(attention_args(tokens, h, dim), reps) for h in heads}
    (h1, t1), (h2, t2) = zip(heads, seconds.values())
    rate = (h2 - h1) * flops(tokens, 1) / max(t2 - t1, 1e-9)
    bandwidth = tokens * per_token / max(t1 - flops(tokens, h1) / rate, 1e-9)
    small = 16
    small_reps = max(reps, SMALL_REPS)
    seconds[f"{small} tokens, 1 head"] = t_small = _time_op(attention_args(small, 1, dim), small_reps)
    overhead = max(0.0, t_small - small * per_token / bandwidth - flops(small, 1) / rate)
    cache = private_cache_bytes() if cache_bytes is None else cache_bytes
    cache_bandwidth = bandwidth

    def measured_bandwidth(n: int, buffers: int = 1) -> float:
        extra = [attention_args(n, 1, dim) for _ in range(buffers - 1)]
        label = f"{n} tokens, 1 head" + (f", {buffers} buffers alternating" if buffers > 1 else "")
        seconds[label] = t = _time_op(attention_args(n, 1, dim), small_reps, *extra)
        # never below the memory's: a slower figure is a call the machine's load slowed down
        return max(bandwidth, n * per_token / max(t - overhead - flops(n, 1) / rate, 1e-9))

    if cache:
        resident = max(16, cache // 2 // per_token)
        cache_bandwidth = measured_bandwidth(resident)
    sizes = sorted({*(b // per_token for b in CURVE_BYTES), *((max(16, cache // 2 // per_token),) if cache else ())})
    curve = tuple((n * per_token, measured_bandwidth(n, CURVE_BUFFERS)) for n in sizes if n < tokens)
    return AttentionCalibration(bandwidth, rate, overhead, cache, cache_bandwidth, seconds, curve)


PREFILL_LINEAR = (512, 1024, 1024)  # (rows, in, out): a prefill chunk through a linear
PREFILL_ATTENTION = (1024, 8, 64)  # (tokens, heads, head dim): a causal square
PREFILL_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class PrefillCalibration:
    """One thread's prefill rates by element width: ``((bytes, FLOP/s), ...)``."""

    linear_flops: tuple[tuple[int, float], ...]
    attention_flops: tuple[tuple[int, float], ...]


def _best_thread_time(call, reps: int) -> float:
    call()
    best = float("inf")
    for _ in range(reps):
        start = time.thread_time()
        call()
        best = min(best, time.thread_time() - start)
    return max(best, 1e-9)


def calibrate_prefill(linear: tuple[int, int, int] = PREFILL_LINEAR,
                      attention: tuple[int, int, int] = PREFILL_ATTENTION,
                      dtypes: tuple[str, ...] = PREFILL_DTYPES, reps: int = 3) -> PrefillCalibration:
    """One thread's ``F.linear`` of ``[M, K]`` by ``[N, K]`` (``2·M·K·N`` FLOPs) and causal flash
    attention of ``n`` tokens (``4·H·D·n(n+1)/2`` FLOPs, the ``QKᵀ`` and ``PV`` products over the
    visible keys, as :mod:`.prefill_cost` counts them) in each dtype: best of ``reps`` thread times."""
    import torch
    import torch.nn.functional as F

    m, k, n = linear
    tokens, heads, dim = attention
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    linear_rates, attention_rates = [], []
    try:
        for name in dtypes:
            dtype = getattr(torch, name)
            g = torch.Generator().manual_seed(0)
            x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
            linear_rates.append((x.element_size(), 2.0 * m * k * n / _best_thread_time(partial(F.linear, x, w), reps)))
            q, kk, v = (torch.randn(1, heads, tokens, dim, generator=g).to(dtype) for _ in range(3))
            seconds = _best_thread_time(partial(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, q, kk, v,
                                                0.0, True, scale=dim ** -0.5), reps)
            attention_rates.append((q.element_size(), 4.0 * heads * dim * tokens * (tokens + 1) / 2 / seconds))
    finally:
        torch.set_num_threads(threads)
    return PrefillCalibration(tuple(linear_rates), tuple(attention_rates))


def measure_links(reps: int = 20) -> dict[str, tuple[float, float]]:
    """``{collective: (latency_s, bandwidth bytes/s)}`` for ``all_gather`` and ``all_to_all`` in
    the current gloo world, over the transport the graphs' collectives will take (shared memory
    where every rank is on this host, :mod:`dcpgraph.runtime.host_collectives`; else gloo). Call
    on every rank at once; the figures are this rank's.

    A call's time is that of ``LINK_BURST`` back-to-back calls over their count, after one untimed
    call that absorbs the ranks' skew leaving the barrier (up to a scheduler slice, more than a
    shared-memory collective takes): within the burst each call starts when the last one ended on
    every rank, as a layer's collectives do in a decode step."""
    import torch
    import torch._C._distributed_c10d as c10d
    import torch.distributed as dist


    world = dist.get_world_size()
    elements = LINK_CHUNK_BYTES // 4
    group, _ = host_collectives.wrap(dist.group.WORLD)

    def run(name: str, n: int) -> float:
        if name == "all_gather":
            send, out = torch.ones(n), torch.empty(n * world)
            call = lambda: group._allgather_base(out, send, c10d.AllgatherOptions()).wait()  # noqa: E731
        else:
            send, out = torch.ones(n * world), torch.empty(n * world)
            call = lambda: group.alltoall_base(out, send, [], [], c10d.AllToAllOptions()).wait()  # noqa: E731
        call()
        best = float("inf")
        for _ in range(reps):
            dist.barrier()
            call()  # absorbs the skew
            start = time.perf_counter()
            for _ in range(LINK_BURST):
                call()
            best = min(best, (time.perf_counter() - start) / LINK_BURST)
        return best

    out = {}
    try:
        for name in ("all_gather", "all_to_all"):
            latency = run(name, 1)
            big = run(name, elements)
            # a latency sample slower than the big call was slowed by the machine's load: then the
            # whole big call counts as transfer (a lower bound on the bandwidth)
            transfer = big - latency if big > latency else big
            out[name] = (latency, (world - 1) * LINK_CHUNK_BYTES / transfer)
    finally:
        host_collectives.release(group)
    return out


def _links_worker(rank: int, world: int, reps: int) -> dict:
    return measure_links(reps)


def measure_this_machine(links: bool = True, **calibration) -> Hardware:
    """This machine as one rank: physical memory, :func:`calibrate_attention`'s figures,
    :func:`calibrate_prefill`'s (the prefill's rates per dtype) and, with
    ``links``, :func:`measure_links` between two gloo processes on it (a few seconds more; the
    latency and bandwidth are the two collectives' means). Without ``links`` the link figures are
    loopback assumptions, not measurements: 5 GB/s, 200 µs per collective."""
    cal = calibrate_attention(**calibration)
    prefill = calibrate_prefill()
    link_bw, link_latency, how = 5e9, 200e-6, "links assumed"
    if links:
        measured = spawn(_links_worker, 2, 10, timeout_s=120)[0]
        link_latency = statistics.mean(lat for lat, _ in measured.values())
        link_bw = statistics.mean(bw for _, bw in measured.values())
        how = "gloo links measured (all_gather, all_to_all)"
    return Hardware(MEASURED, physical_memory(), cal.bandwidth, cal.compute_flops, link_bw, link_latency,
                    compute_overlaps_memory=False, attention_overhead_s=cal.overhead_s,
                    cache_bytes=cal.cache_bytes, cache_bandwidth=cal.cache_bandwidth,
                    bandwidth_curve=cal.bandwidth_curve, linear_flops=prefill.linear_flops,
                    prefill_attention_flops=prefill.attention_flops,
                    source=f"measured: paged_attention and prefill calibration on this CPU; {how}")


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
