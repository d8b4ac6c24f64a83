"""``comm="auto"``: the DCP lowering the decode-step cost model (:mod:`.cost`) predicts cheapest.

Candidates are the lowerings valid for the program: ``a2a`` and ``ag_rs`` always; ``ag`` only for
GQA attention that :func:`dcpgraph.passes.shard_dcp_replicated.ag_rules` accepts (every context
read a plain paged attention between one column-parallel query projection and one row-parallel
output projection with no head-sharded state or collective in between; at ``dcp == tp`` that
projection feeds its own TP all-reduce). A refused lowering is listed with the refusal, never
chosen. Each candidate is priced with :func:`.cost.decode_step`, the planner's per-rank model:

* its DCP collectives and TP all-reduces per layer (``latency + bytes / bandwidth`` each), over
  the link of the collective backend in use (:func:`link_hardware`; under a running gloo world,
  as its ranks measure it at start-up, :func:`measured_link`);
* its weight read: the program's own per-rank weight bytes, plus for ``ag`` the bytes its rules
  add (the DCP group's query projection, and the whole output projection at ``dcp == tp``);
* the attention, the same for every candidate (it only moves the working set a little).

A candidate whose weights plus the engine's KV cache exceed the rank's memory
(``Hardware.memory_bytes``) is refused. The cheapest step wins; exact ties go to
:data:`~.planner.COMM_PREFERENCE` (fewest weights).

**Where it is evaluated.** One decode step of ``batch = min(max_num_seqs, requests of that context
the KV cache holds)`` requests at ``context = max_model_len // 2``. A request's context grows from
its prompt to at most ``max_model_len``, so half of it is the middle of a long-context decode's
life; only the attention term depends on the context and it is the same for every candidate, so
the choice barely moves with it. The batch matters: query and packed-partial bytes scale with it,
``ag``'s gather by ``dcp`` times more, while ``ag``'s extra weight bytes do not. The choice ignores
speculative verification's extra query tokens per request.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .cost import StepCost, decode_step
from .hardware import GB, PRESETS, Hardware, physical_memory
from .model_shape import ModelShape
from .planner import COMM_PREFERENCE

LINK_BACKENDS = ("gloo", "nccl", "hccl")

# Ranks on one host over gloo: measured by benchmarks/plan_calibration.py on this project's 2-core
# VM (benchmarks/results/plan_calibration.json: all_gather 166 us / 1.8 GB/s, all_to_all 86 us /
# 2.5 GB/s per collective, paged_attention reading 15.6 GB/s and computing 99 GFLOP/s on one thread).
HOST_LINK_LATENCY_S = 120e-6
HOST_LINK_BANDWIDTH = 2e9
HOST_MEMORY_BANDWIDTH = 15e9
HOST_COMPUTE_FLOPS = 100e9


def link_hardware(backend: str, *, ranks_per_host: int = 1, device_name: str = "") -> Hardware:
    """The figures ``comm="auto"`` prices with for the collective backend ``backend``: ``gloo``,
    ranks on one host sharing its memory (:data:`HOST_LINK_LATENCY_S` and friends); ``nccl``, the
    GPU preset the device name matches (``h200`` when none does); ``hccl``, the Ascend preset."""
    if backend == "gloo":
        return Hardware("host-gloo", physical_memory() // max(1, ranks_per_host), HOST_MEMORY_BANDWIDTH,
                        HOST_COMPUTE_FLOPS, HOST_LINK_BANDWIDTH, HOST_LINK_LATENCY_S,
                        compute_overlaps_memory=False,
                        source="gloo between processes of one host, measured by benchmarks/plan_calibration.py")
    name = device_name.upper()
    if backend == "nccl":
        key = "b200" if "B200" in name else "h200"
        hw = PRESETS[key]
        return hw if key.upper() in name else replace(hw, source=f"{hw.source} (assumed for {device_name or 'a GPU'})")
    if backend == "hccl":
        return PRESETS["ascend-a3" if "910C" in name or "A3" in name else "ascend-910b"]
    raise ValueError(f"no link figures for collective backend {backend!r}; known: {list(LINK_BACKENDS)}")


def measured_link(hw: Hardware, reps: int = 5) -> Hardware:
    """``hw`` with the link figures of the running gloo world, measured now
    (:func:`.calibration.measure_links`: ``all_gather`` and ``all_to_all``, the means of their
    latencies and bandwidths) and agreed by every rank: each takes the slowest rank's latency and
    bandwidth (one ``all_reduce`` of MAX), so every rank prices, and chooses, alike. Call on every
    rank at once, as every collective; the figures include this host's load at start-up."""
    import statistics

    import torch
    import torch.distributed as dist

    from .calibration import measure_links

    links = measure_links(reps)
    latency = statistics.mean(lat for lat, _ in links.values())
    bandwidth = statistics.mean(bw for _, bw in links.values())
    agreed = torch.tensor([latency, 1.0 / bandwidth], dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    latency, bandwidth = float(agreed[0]), 1.0 / float(agreed[1])
    world = dist.get_world_size()
    return replace(hw, name=f"{hw.name}, measured at start-up", link_latency_s=latency, link_bandwidth=bandwidth,
                   source=f"all_gather and all_to_all timed between the {world} ranks at start-up (over shared "
                          "memory where they share a host, else gloo) "
                          f"(the slowest rank's figures); the rest: {hw.source}")


@dataclass(frozen=True)
class CommWorkload:
    """What ``comm="auto"`` is evaluated for (module docstring): the link's hardware, and the
    engine's ``max_model_len``, ``max_num_seqs`` and cache-size option (``num_blocks``,
    ``kv_cache_tokens`` or ``kv_cache_bytes_per_rank``, at most one; none: every sequence slot at
    ``max_model_len``, the engine's default)."""

    hardware: Hardware
    max_model_len: int = 4096
    max_num_seqs: int = 8
    cache_size: tuple[tuple[str, int], ...] = ()  # (option name, value) pairs

    @property
    def context(self) -> int:
        return max(1, self.max_model_len // 2)


@dataclass(frozen=True)
class CommCandidate:
    comm: str
    refused: str = ""  # why it is not a candidate: an invalid lowering, or weights that do not fit
    cost: StepCost | None = None
    weight_bytes_per_rank: int = 0

    def collective_s_per_layer(self, layers: int) -> float:
        """DCP collectives plus TP all-reduces of one layer."""
        return (self.cost.collective_s + self.cost.tp_allreduce_s) / layers


@dataclass(frozen=True)
class CommChoice:
    comm: str
    reason: str
    candidates: tuple[CommCandidate, ...]
    hardware: Hardware
    context: int
    batch: int
    layers: int

    def refuse(self, comm: str, why: str) -> CommChoice:
        """This choice with ``comm`` refused for ``why`` (e.g. its lowering failed to verify)."""
        marked = tuple(CommCandidate(c.comm, why, None, c.weight_bytes_per_rank) if c.comm == comm else c
                       for c in self.candidates)
        return _select(marked, self.hardware, self.context, self.batch, self.layers)


def choose_comm(shape: ModelShape, hw: Hardware, *, tp: int, dcp: int, context: int, batch: int,
                kv_bytes_per_token_layer: float, kv_bytes_per_rank: int, weight_bytes: dict[str, int],
                refused: dict[str, str]) -> CommChoice:
    """The cheapest lowering of ``weight_bytes``' keys (each: that lowering's weight bytes per
    rank) not in ``refused`` (lowering -> why it is invalid), priced as the module docstring says."""
    comms = sorted(weight_bytes, key=COMM_PREFERENCE.__getitem__)
    candidates = []
    for comm in comms:
        weights = weight_bytes[comm]
        if refused.get(comm):
            candidates.append(CommCandidate(comm, refused[comm], weight_bytes_per_rank=weights))
            continue
        if weights + kv_bytes_per_rank > hw.memory_bytes:
            candidates.append(CommCandidate(
                comm, f"weights {weights / GB:.2f} GB + KV {kv_bytes_per_rank / GB:.2f} GB per rank exceed "
                      f"{hw.name}'s {hw.memory_bytes / GB:.2f} GB", weight_bytes_per_rank=weights))
            continue
        cost = decode_step(shape, hw, tp=tp, dcp=dcp, comm=comm, context=context, batch=batch,
                           kv_bytes_per_token_layer=kv_bytes_per_token_layer, weight_bytes=weights)
        candidates.append(CommCandidate(comm, cost=cost, weight_bytes_per_rank=weights))
    return _select(tuple(candidates), hw, context, batch, shape.num_layers)


def _select(candidates: tuple[CommCandidate, ...], hw: Hardware, context: int, batch: int,
            layers: int) -> CommChoice:
    priced = [c for c in candidates if c.cost is not None]
    if priced:
        best = min(priced, key=lambda c: (c.cost.step_s, COMM_PREFERENCE[c.comm])).comm
        why = "cheapest predicted decode step"
    else:  # nothing fits: a2a (the fewest weights, always valid); the engine's allocation says what is short
        best = "a2a"
        why = "no lowering fits the memory; the fewest weights"
    parts = []
    for c in candidates:
        if c.cost is None:
            parts.append(f"{c.comm} refused: {c.refused}")
        else:
            parts.append(f"{c.comm} {c.collective_s_per_layer(layers) * 1e3:.3f} ms collectives per "
                         f"layer, {c.weight_bytes_per_rank / 2**20:.2f} MiB weights per rank, step "
                         f"{c.cost.step_s * 1e3:.3f} ms")
    reason = (f"{best}: {why} on {hw.name} (link {hw.link_latency_s * 1e6:.0f} us + "
              f"{hw.link_bandwidth / 1e9:.3g} GB/s per collective) at context {context}, batch {batch}: "
              + "; ".join(parts))
    return CommChoice(best, reason, candidates, hw, context, batch, layers)
