"""``plan(...)``: every (tp, dcp, interleave, comm) for a model, a world size, hardware and a KV
budget, with capacity (the formulas of :mod:`dcpgraph.capacity`, as the compiled program uses
them), predicted decode cost (:mod:`.cost`) and a recommendation for the workload.

DCP adds no ranks (the world of one engine is its TP group), so a world of ``W`` ranks runs
``W // tp`` independent replicas of a ``tp``-rank engine; every divisor ``tp`` of ``W`` is
listed. Mesh validity is :meth:`dcpgraph.Mesh.validate` itself: an invalid mesh is listed with
the message of the rule it breaks.

Nodes. ``nnodes`` machines of ``gpus_per_node`` devices make a world of ``nnodes · gpus_per_node``
ranks, numbered node by node, and each layout is those ranks cut into ``dp = W / tp`` consecutive
TP groups (vLLM's ``-dp``/``-tp``), each cut into consecutive DCP groups. A group that spans nodes
(``tp = 16`` on nodes of 8) pays the inter-node link for its collectives (:func:`~.cost.link_for`);
``tp = 8, dp = 2`` on the same two nodes keeps every collective inside a node. Each row says how
many nodes one replica spans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .. import capacity
from ..errors import ConfigError
from ..mesh import Mesh
from . import compressed_capacity
from .calibration import get_hardware
from .compressed_model import check_output_groups
from .cost import StepCost, decode_step
from .hardware import Hardware, nodes_spanned
from .model_shape import ModelShape, load_model_shape
from .prefill_plan import PrefillRow, fastest, prefill_rows

TIE = 0.02  # throughputs within 2 % count as equal: the smaller dcp (fewer collectives) wins
COMM_PREFERENCE = {"a2a": 0, "ag_rs": 1, "ag": 2}  # among equals: ag holds dcp× the query projection


@dataclass
class PlanRow:
    tp: int
    dcp: int
    interleave: int
    comm: str
    kv_cache_dtype: str
    replicas: int
    valid: bool
    rule: str = ""  # why the mesh is refused (Mesh.validate's message), or why it does not fit
    weight_bytes_per_rank: int = 0
    kv_budget_bytes_per_rank: int = 0
    kv_bytes_per_token: float = 0.0  # per rank
    state_bytes_per_request: int = 0  # per rank: a hybrid's recurrent state (0 for a plain transformer)
    bytes_per_block: int = 0
    num_blocks: int = 0
    capacity_tokens: int = 0
    max_concurrency: int = 0  # per replica, at the workload's context
    request_bytes: int = 0  # DeepSeek-V4: one request's cache bytes per rank at the workload's context
    batch: int = 0  # requests per replica in the predicted step
    cost: StepCost | None = None
    tokens_per_s: float = 0.0  # all replicas
    nodes: int = 1  # nodes one replica (its TP group) spans

    @property
    def fits(self) -> bool:
        return self.valid and not self.rule

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "cost"}
        if self.cost is not None:
            d.update(attention_ms=self.cost.attention_s * 1e3, collective_ms=self.cost.collective_s * 1e3,
                     collective_bytes_per_layer=self.cost.collective_bytes_per_layer,
                     tp_allreduce_ms=self.cost.tp_allreduce_s * 1e3, weights_ms=self.cost.weights_s * 1e3,
                     step_ms=self.cost.step_s * 1e3)
        return d


@dataclass
class Plan:
    model: ModelShape
    hardware: Hardware
    world_size: int
    block_size: int
    max_model_len: int
    context_len: int
    concurrency: int | None
    rows: list[PlanRow]
    recommended: PlanRow | None
    reason: str
    assumptions: list[str] = field(default_factory=list)
    nnodes: int = 1
    gpus_per_node: int = 0  # devices per node (0: the whole world on one node)
    prompt_len: int | None = None  # the prefill workload (TTFT of one prompt), when asked
    prefill_rows: list[PrefillRow] = field(default_factory=list)
    prefill_recommended: PrefillRow | None = None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def routed_fraction_read(shape: ModelShape, batch: int) -> float:
    """Expected fraction of routed experts a decode step of ``batch`` tokens touches (uniform
    routing): ``1 − (1 − k/E)^batch``."""
    if not shape.n_routed_experts:
        return 1.0
    return 1.0 - (1.0 - shape.experts_per_token / shape.n_routed_experts) ** batch


def weight_read_bytes(shape: ModelShape, tp: int, batch: int, weight_bytes: float, experts: str,
                      dcp: int = 1, comm: str = "a2a") -> int:
    full = shape.weight_params_per_rank(tp, experts, dcp, comm)
    routed = shape.routed_expert_params_per_rank(tp, experts)
    return int((full - routed + routed * routed_fraction_read(shape, batch)) * weight_bytes)


def world_of(world_size: int | None, nnodes: int, gpus_per_node: int | None) -> tuple[int, int]:
    """``(world size, devices per node)`` from any two of them (``nnodes`` defaults to 1)."""
    if nnodes < 1:
        raise ConfigError(f"nnodes must be >= 1, got {nnodes}")
    if gpus_per_node is not None:
        if gpus_per_node < 1:
            raise ConfigError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
        if world_size is not None and world_size != nnodes * gpus_per_node:
            raise ConfigError(f"world_size={world_size} is not nnodes={nnodes} x gpus_per_node={gpus_per_node}; "
                              "give world_size or the nodes, or both consistent")
        return nnodes * gpus_per_node, gpus_per_node
    if world_size is None:
        raise ConfigError("give world_size, or nnodes and gpus_per_node")
    if world_size % nnodes:
        raise ConfigError(f"world_size={world_size} does not split evenly over nnodes={nnodes}")
    return world_size, world_size // nnodes


def plan(model, *, world_size: int | None = None, hardware: str | Hardware = "h200",
         kv_cache_memory_bytes: int | None = None, gpu_memory_utilization: float | None = None, block_size: int = 16,
         kv_cache_dtype: str = "auto", max_model_len: int, context_len: int | None = None,
         concurrency: int | None = None, weight_dtype_bytes: float | None = None, experts: str = "sharded",
         nnodes: int = 1, gpus_per_node: int | None = None, prompt_len: int | None = None,
         pcp_sizes: tuple[int, ...] | None = None) -> Plan:
    """Every candidate layout of ``world_size`` ranks, evaluated; see the module docstring.

    The world: ``world_size`` ranks on one node, or ``nnodes`` nodes of ``gpus_per_node`` devices
    (either may be given with ``world_size``; :func:`world_of`). Exactly one of
    ``kv_cache_memory_bytes`` (KV bytes per rank) and ``gpu_memory_utilization`` (fraction of
    device memory; KV gets what the weights leave) sizes the cache. ``context_len`` (default
    ``max_model_len``) and ``concurrency`` (default: as many as fit) are the workload.
    ``prompt_len`` adds the prefill table (:mod:`.prefill_plan`): TTFT of one such prompt for
    every ``(tp, pcp)`` layout, ``pcp`` among ``pcp_sizes`` (default: every divisor of the world).
    """
    world_size, per_node = world_of(world_size, nnodes, gpus_per_node)
    shape = load_model_shape(model)
    hw = hardware if isinstance(hardware, Hardware) else get_hardware(hardware)
    if (kv_cache_memory_bytes is None) == (gpu_memory_utilization is None):
        raise ConfigError("give exactly one of kv_cache_memory_bytes and gpu_memory_utilization")
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if world_size < 1 or block_size < 1 or max_model_len < 1:
        raise ConfigError("world_size, block_size and max_model_len must be positive")
    context = context_len or max_model_len
    if context > max_model_len:
        raise ConfigError(f"context_len {context} exceeds max_model_len {max_model_len}")
    if concurrency is not None and concurrency < 1:
        raise ConfigError(f"concurrency must be >= 1, got {concurrency}")
    shape.kv_element_bytes(kv_cache_dtype)  # validates the name
    if shape.attention == "compressed" and kv_cache_dtype == "fp8_e4m3":
        raise ConfigError(f"{shape.name}: an fp8_e4m3 cache is not modelled for DeepSeek-V4's compressed caches "
                          "(no compiled fp8 layer to take its scale layout from); use kv_cache_dtype "
                          "'auto', 'bf16', 'fp16' or 'fp32'")
    wbytes = weight_dtype_bytes or shape.dtype_bytes
    rows: list[PlanRow] = []
    for tp in sorted(_divisors(world_size), reverse=True):
        for dcp in range(1, tp + 1):
            interleaves = (1,) if dcp == 1 else tuple(sorted({1, block_size}))
            # comm="ag" replicates the query projection, which only GQA's lowering finds.
            comms = ("none",) if dcp == 1 else ("a2a", "ag_rs", "ag") if shape.attention == "gqa" else ("a2a", "ag_rs")
            try:
                # V4's single K=V head is replicated over TP like MLA's latent: MLA's mesh rules.
                Mesh(tp, dcp).validate(attention="mla" if shape.attention == "compressed" else shape.attention,
                                       num_q_heads=shape.num_q_heads, num_kv_heads=shape.num_kv_heads,
                                       block_size=block_size)
                if shape.attention == "compressed":
                    check_output_groups(shape, tp)
            except ConfigError as err:
                rows.append(PlanRow(tp, dcp, 1, "-", kv_cache_dtype, world_size // tp, False, str(err)))
                continue
            for interleave in interleaves:
                for comm in comms:
                    rows.append(_evaluate(shape, hw, tp, dcp, interleave, comm, kv_cache_dtype, world_size,
                                          block_size, max_model_len, context, concurrency, wbytes, experts,
                                          kv_cache_memory_bytes, gpu_memory_utilization, per_node))
    best, reason = _recommend(rows, context, concurrency)
    assumptions = [
        f"routed experts {experts} over tp; weights {wbytes:g} B/param",
        f"KV cache {kv_cache_dtype}" + (" (modelled: 1 B/element + one fp32 scale per 128 elements per "
                                         "token and head; dcpgraph does not compile an fp8 cache yet)"
                                         if kv_cache_dtype == "fp8_e4m3" else ""),
        f"hardware {hw.name}: {hw.memory_bandwidth / 1e9:,.0f} GB/s, {hw.compute_flops / 1e9:,.0f} GFLOP/s, "
        f"link {hw.link_bandwidth / 1e9:.0f} GB/s + {hw.link_latency_s * 1e6:.0f} us per collective ({hw.source})",
    ]
    if shape.attention == "compressed":
        assumptions += _compressed_assumptions(shape, rows, context)
    if shape.recurrent_layers:
        states = sorted({(r.tp, r.state_bytes_per_request) for r in rows if r.valid})
        assumptions.append(f"{shape.recurrent_layers} gated delta net layers ({shape.attention_layers} with KV): "
                           "recurrent state per request per rank, taken from the budget before the KV blocks: "
                           + ", ".join(f"tp={tp}: {b / 2**20:,.2f} MiB" for tp, b in states))
    if nnodes > 1:
        assumptions.append(f"{nnodes} nodes x {per_node} devices, ranks numbered node by node; a group spanning "
                           f"nodes runs at the inter-node link, {hw.inter_node_bandwidth / 1e9:.0f} GB/s + "
                           f"{hw.inter_node_latency_s * 1e6:.0f} us per node hop")
    result = Plan(shape, hw, world_size, block_size, max_model_len, context, concurrency, rows, best, reason,
                  assumptions, nnodes, per_node)
    if prompt_len is not None or pcp_sizes is not None:
        result.prompt_len = prompt_len or context
        result.prefill_rows = prefill_rows(shape, hw, world_size=world_size, per_node=per_node,
                                           prompt_len=result.prompt_len, weight_bytes=wbytes, pcp_sizes=pcp_sizes,
                                           weight_budget_bytes=(int(gpu_memory_utilization * hw.memory_bytes)
                                                                if gpu_memory_utilization is not None
                                                                else hw.memory_bytes - kv_cache_memory_bytes))
        result.prefill_recommended = fastest(result.prefill_rows)
        assumptions.append("prefill: TTFT of one prompt, no cached prefix, the busiest PCP rank of the zigzag split; "
                           "(dense + attention FLOPs) / compute + one K/V all-gather per layer + TP all-reduces, "
                           "no overlap (dcpgraph.plan.prefill_cost)")
    return result


def fitting_sequences(budget: int, bytes_per_block: int, state_bytes_per_request: int, context: int,
                      block_size: int, dcp: int) -> int:
    """The most requests of ``context`` tokens a rank's ``budget`` holds: the largest ``N`` with
    ``N ≤ max_sequences(blocks_for_bytes(budget − N · state_bytes_per_request))``, the engine's
    sizing with ``max_num_seqs = N`` (its state pools come out of the budget before the KV blocks;
    :mod:`dcpgraph.memory`). Without recurrent state, ``max_sequences`` of the whole budget."""

    def fits(n: int) -> bool:
        left = budget - n * state_bytes_per_request
        return left >= bytes_per_block and capacity.max_sequences(
            capacity.blocks_for_bytes(left, bytes_per_block), context, block_size, dcp) >= n

    hi = capacity.max_sequences(capacity.blocks_for_bytes(budget, bytes_per_block), context, block_size, dcp)
    if not state_bytes_per_request:
        return hi
    lo = 0  # fits(n) is monotone: a larger n has less KV budget and needs more sequences
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _evaluate(shape, hw, tp, dcp, interleave, comm, kv_dtype, world, block_size, max_model_len, context,
              concurrency, wbytes, experts, kv_bytes, utilization, per_node) -> PlanRow:
    row = PlanRow(tp, dcp, interleave, comm, kv_dtype, world // tp, True, nodes=nodes_spanned(tp, world, per_node))
    row.weight_bytes_per_rank = int(shape.weight_params_per_rank(tp, experts, dcp, comm) * wbytes)
    if shape.attention == "compressed":
        return _evaluate_compressed(row, shape, hw, kv_dtype, world, max_model_len, context, concurrency,
                                    wbytes, experts, kv_bytes, utilization, per_node)
    caches = shape.cache_shapes(tp, kv_dtype)
    row.bytes_per_block = capacity.bytes_per_block(caches, block_size)
    row.kv_bytes_per_token = float(capacity.bytes_per_token(caches, block_size, dcp))
    budget = kv_bytes if kv_bytes is not None else int(utilization * hw.memory_bytes) - row.weight_bytes_per_rank
    row.kv_budget_bytes_per_rank = budget
    if budget < row.bytes_per_block:
        row.rule = (f"no room for the KV cache: {row.weight_bytes_per_rank / 2**30:,.1f} GiB of weights per "
                    f"rank leave {budget / 2**30:,.1f} GiB of the budget")
        return row
    row.state_bytes_per_request = shape.recurrent_state_bytes_per_request(tp)
    sequences = fitting_sequences(budget, row.bytes_per_block, row.state_bytes_per_request, context, block_size, dcp)
    row.num_blocks = capacity.blocks_for_bytes(budget - sequences * row.state_bytes_per_request, row.bytes_per_block)
    row.capacity_tokens = capacity.capacity_tokens(row.num_blocks, block_size, dcp)
    if row.weight_bytes_per_rank + budget > hw.memory_bytes:
        row.rule = (f"weights {row.weight_bytes_per_rank / 2**30:,.1f} GiB + KV {budget / 2**30:,.1f} GiB per rank "
                    f"exceed {hw.name}'s {hw.memory_bytes / 2**30:,.1f} GiB")
        return row
    if row.state_bytes_per_request and not sequences:
        row.rule = (f"no room for one request of {context:,} tokens: its recurrent state "
                    f"({row.state_bytes_per_request / 2**20:,.1f} MiB per rank) and KV exceed the budget")
        return row
    if row.capacity_tokens < max_model_len:
        row.rule = f"capacity {row.capacity_tokens:,} tokens < max_model_len {max_model_len:,}"
        return row
    row.max_concurrency = sequences
    wanted = math.ceil(concurrency / row.replicas) if concurrency else row.max_concurrency
    row.batch = max(1, min(wanted, row.max_concurrency))
    per_layer = sum(c.bytes_per_token for c in caches) / shape.num_layers
    row.cost = decode_step(shape, hw, tp=tp, dcp=dcp, comm=comm, context=context, batch=row.batch,
                           kv_bytes_per_token_layer=per_layer,
                           weight_bytes=weight_read_bytes(shape, tp, row.batch, wbytes, experts, dcp, comm),
                           tp_nodes=row.nodes, dcp_nodes=nodes_spanned(dcp, world, per_node))
    row.tokens_per_s = row.replicas * row.batch / row.cost.step_s
    return row


def _compressed_assumptions(shape, rows: list[PlanRow], context: int) -> list[str]:
    """What V4's rows assume, and one request's bytes per rank for each (dcp, interleave) listed."""
    lines = [
        "DeepSeek-V4 caches are not paged: per rank one request holds its raw window's share, its compressed "
        "entries and CSA indexer keys (in the cache dtype) dealt by the interleave rule on entry indices, and "
        "the compressors' open windows on every rank (dcpgraph.plan.compressed_cache); max conc = budget // "
        "request bytes, KV tokens = the longest request that fits alone, KV B/token/rank = entry + indexer "
        "bytes per token as the context grows",
        "DeepSeek-V4 attention reads per layer the window, HCA's entries, CSA's indexer keys and its top-k "
        "entries over the DCP group (dcpgraph.plan.compressed_capacity); CSA's top-k candidate all-gather "
        "is not costed",
    ]
    seen = set()
    for r in rows:
        if not r.valid or (r.dcp, r.interleave) in seen:
            continue
        seen.add((r.dcp, r.interleave))
        got = compressed_capacity.request_bytes(shape, context, r.dcp, r.interleave, r.kv_cache_dtype)
        lines.append(f"one {context:,}-token request per rank at dcp={r.dcp} interleave={r.interleave}: "
                     f"{got.total / 2**20:,.1f} MiB = window {got.window / 2**20:,.1f} + entries "
                     f"{got.compressed / 2**20:,.1f} + indexer keys {got.indexer / 2**20:,.1f} + open windows "
                     f"{got.open_windows / 2**20:,.1f} MiB; {float(got.per_token):,.1f} B/token")
    return lines


def _evaluate_compressed(row, shape, hw, kv_dtype, world, max_model_len, context, concurrency, wbytes,
                         experts, kv_bytes, utilization, per_node) -> PlanRow:
    """DeepSeek-V4: capacity from one request's bytes per rank (:mod:`.compressed_capacity`), not
    from blocks; ``capacity_tokens`` is the longest request that fits alone."""
    tp, dcp, interleave = row.tp, row.dcp, row.interleave
    budget = kv_bytes if kv_bytes is not None else int(utilization * hw.memory_bytes) - row.weight_bytes_per_rank
    row.kv_budget_bytes_per_rank = budget
    at_context = compressed_capacity.request_bytes(shape, context, dcp, interleave, kv_dtype)
    row.kv_bytes_per_token = float(at_context.per_token)
    row.request_bytes = at_context.total
    row.capacity_tokens = max(0, compressed_capacity.longest_request(shape, budget, dcp, interleave, kv_dtype, max_model_len))
    if row.capacity_tokens == 0:
        row.rule = (f"no room for the caches: {row.weight_bytes_per_rank / 2**30:,.1f} GiB of weights per "
                    f"rank leave {budget / 2**30:,.1f} GiB of the budget")
        return row
    if row.weight_bytes_per_rank + budget > hw.memory_bytes:
        row.rule = (f"weights {row.weight_bytes_per_rank / 2**30:,.1f} GiB + KV {budget / 2**30:,.1f} GiB per rank "
                    f"exceed {hw.name}'s {hw.memory_bytes / 2**30:,.1f} GiB")
        return row
    if row.capacity_tokens < max_model_len:
        row.rule = f"capacity {row.capacity_tokens:,} tokens < max_model_len {max_model_len:,}"
        return row
    row.max_concurrency = compressed_capacity.max_requests(shape, budget, context, dcp, interleave, kv_dtype)
    wanted = math.ceil(concurrency / row.replicas) if concurrency else row.max_concurrency
    row.batch = max(1, min(wanted, row.max_concurrency))
    read = compressed_capacity.attention_read(shape, tp, dcp, interleave, context, row.batch,
                                              shape.kv_element_bytes(kv_dtype))
    row.cost = decode_step(shape, hw, tp=tp, dcp=dcp, comm=row.comm, context=context, batch=row.batch,
                           kv_bytes_per_token_layer=0.0, layer_read=read,
                           weight_bytes=weight_read_bytes(shape, tp, row.batch, wbytes, experts, dcp, row.comm),
                           tp_nodes=row.nodes, dcp_nodes=nodes_spanned(dcp, world, per_node))
    row.tokens_per_s = row.replicas * row.batch / row.cost.step_s
    return row


def _recommend(rows: list[PlanRow], context: int, concurrency: int | None) -> tuple[PlanRow | None, str]:
    fitting = [r for r in rows if r.fits]
    if not fitting:
        return None, "no valid layout holds one max_model_len sequence in the KV budget"
    top = max(r.tokens_per_s for r in fitting)
    near = [r for r in fitting if r.tokens_per_s >= (1 - TIE) * top]
    # Ties go to fewer ranks sharing the KV, then to the lowering holding the fewest weights.
    best = min(near, key=lambda r: (r.dcp, -r.tp, r.interleave, COMM_PREFERENCE.get(r.comm, 0)))
    base = max((r for r in fitting if r.dcp == 1), key=lambda r: r.tokens_per_s, default=None)
    want = f"{concurrency:,} requests" if concurrency else "as many requests as fit"
    head = (f"tp={best.tp} dcp={best.dcp}" + (f" comm={best.comm}" if best.dcp > 1 else "") +
            f": {want} at {context:,} tokens of context; predicted {best.tokens_per_s:,.0f} tok/s "
            f"(step {best.cost.step_s * 1e3:,.2f} ms, batch {best.batch:,} per replica, "
            f"{best.max_concurrency:,} fit)")
    if base is None or base is best:
        other = max((r for r in fitting if r.dcp > 1), key=lambda r: r.tokens_per_s, default=None)
        if other is None:
            return best, head + "; no dcp > 1 layout is valid and fits"
        return best, (head + f"; the best dcp>1 (dcp={other.dcp}) holds {other.max_concurrency:,} but predicts "
                      f"{other.tokens_per_s:,.0f} tok/s: its collectives add {other.cost.collective_s * 1e3:,.2f} "
                      f"ms per step while attention only drops from {base.cost.attention_s * 1e3:,.2f} to "
                      f"{other.cost.attention_s * 1e3:,.2f} ms")
    return best, (head + f"; dcp=1 (tp={base.tp}) holds {base.max_concurrency:,} sequences of {context:,} "
                  f"tokens per replica vs {best.max_concurrency:,}, runs a batch of {base.batch:,} vs "
                  f"{best.batch:,}, and predicts {base.tokens_per_s:,.0f} tok/s "
                  f"(×{best.tokens_per_s / base.tokens_per_s:.2f} for dcp={best.dcp}); attention "
                  f"{base.cost.attention_s * 1e3:,.2f} → {best.cost.attention_s * 1e3:,.2f} ms per step for "
                  f"those batches, collectives +{best.cost.collective_s * 1e3:,.2f} ms")
