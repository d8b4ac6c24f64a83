"""The :class:`~dcpgraph.runtime.engine.Engine`'s reports: memory per rank, KV sizing, prefix
cache, scheduler, speculation and what ran where. Each is a function of the engine that only
reads it (the engine's methods of the same names call these)."""

from __future__ import annotations

from ..kv_budget import kv_bytes_per_block, kv_bytes_per_block_by_layer
from ..program import weight_bytes_per_rank
from .layer_groups import HybridBlockManager, layer_group_report
from .state_rollback import pool_rows


def memory_report(engine) -> dict:
    """What the engine holds per rank: KV bytes and capacity (per layer group with the hybrid
    cache), weights, the KV sizing, recurrent-state pools and a draft model's cache and weights."""
    per_block = kv_bytes_per_block(engine.program)
    per_rank = per_block * engine.blocks.cache_blocks  # what the caches hold, the scratch block included
    capacity = engine.blocks.capacity_tokens
    groups = {}
    if isinstance(engine.blocks, HybridBlockManager):  # hybrid_kv_cache: sliding layers hold their window
        groups = {"kv_layer_groups": layer_group_report(engine.program, engine.blocks)}
        per_rank = groups["kv_layer_groups"]["full"]["bytes_per_rank"] + groups["kv_layer_groups"]["sliding"]["bytes_per_rank"]
    return {
        **groups,
        "kv_bytes_per_rank": [per_rank for _ in engine.mesh.ranks],
        "kv_bytes_per_token": per_rank / capacity,
        "kv_capacity_tokens": capacity,
        "kv_bytes_per_block_by_layer": kv_bytes_per_block_by_layer(engine.program),
        "num_blocks": engine.blocks.num_blocks,
        "scratch_blocks": engine.blocks.cache_blocks - engine.blocks.num_blocks,
        "block_size": engine.block_size,
        "virtual_block_tokens": engine.block_size * engine.mesh.dcp,
        "tp": engine.mesh.tp,
        "dcp": engine.mesh.dcp,
        "prefix_cache": prefix_cache_report(engine),
        "weight_bytes_per_rank": weight_bytes_per_rank(engine.program),
        "kv_sizing": kv_sizing_report(engine),
        **_recurrent_state_memory(engine),
        **_draft_memory(engine),
    }


def _recurrent_state_memory(engine) -> dict:
    """A hybrid's recurrent-state pools: ``Σ_pools Π(shape per slot) · element_bytes`` per
    request (the formulas of :mod:`dcpgraph.recurrent_state`), times one slot per sequence plus,
    with speculative decoding, one snapshot row per slot (:mod:`dcpgraph.runtime.state_rollback`)."""
    pools = engine.program.recurrent_states
    if not pools:
        return {}
    per_request = sum(p.bytes_per_slot for p in pools)
    slots = int(engine.program.lowering.state_slots)
    snapshots = int(engine.program.lowering.state_snapshots or 0)
    prefix_rows = int(engine.program.lowering.state_prefix_rows or 0)
    return {"recurrent_state_bytes_per_request": per_request, "recurrent_state_slots": slots,
            "recurrent_state_snapshot_slots": snapshots, "recurrent_state_prefix_rows": prefix_rows,
            "recurrent_state_bytes_per_rank": [per_request * pool_rows(engine.program) for _ in engine.mesh.ranks]}


def kv_sizing_report(engine) -> dict:
    """How ``num_blocks`` was chosen: ``policy`` "gpu_memory_utilization" with the figures of
    :class:`~dcpgraph.memory.MemorySizing` (fraction, memory, ranks sharing it, weights,
    activation peak, KV bytes per rank), else ``"cache_size"`` (an explicit or default size)."""
    if engine.memory_sizing is None:
        return {"policy": "cache_size", "num_blocks": engine.blocks.num_blocks}
    return engine.memory_sizing.report()


def _draft_memory(engine) -> dict:
    """A draft model's own KV cache (same blocks, its own per-block bytes) and weights."""
    runner = getattr(engine.runner.proposer, "runner", None)
    if runner is None:
        return {}
    per_rank = kv_bytes_per_block(runner.program) * engine.blocks.num_blocks
    return {"draft_kv_bytes_per_rank": [per_rank for _ in engine.mesh.ranks],
            "draft_weight_bytes_per_rank": weight_bytes_per_rank(runner.program)}


def prefix_cache_report(engine) -> dict:
    """Prefix-cache counters (vLLM's meaning, counted at every admission while caching is on):
    ``queries`` (new requests looked up) and ``query_tokens`` (their prompt tokens),
    ``hit_requests``/``hit_tokens`` (requests with a hit, prompt tokens served from the cache);
    the same for re-admissions after a preemption, apart: ``preempted_queries``,
    ``preempted_query_tokens`` (prompt + output so far) and ``preempted_hit_tokens``;
    ``evictions``, ``cached_blocks`` (virtual blocks holding a hash, in use or free) and
    ``prompt_tokens_computed`` (prompt tokens the ranks actually ran). A hit is one virtual
    block on every DCP rank at once. ``off_reason``: why the default (on where supported) was
    decided off for this model, None when it was not."""
    return {
        "enabled": engine.blocks.enable_prefix_caching,
        "off_reason": getattr(engine, "prefix_caching_off_reason", None),
        **engine.blocks.stats,
        "cached_blocks": engine.blocks.cached_blocks,
        "prompt_tokens_computed": engine.scheduler.prompt_tokens_computed,
    }


def scheduler_report(engine) -> dict:
    """``running``/``waiting`` requests now, ``peak_running``, ``kv_blocks_used`` (virtual
    blocks referenced by a request), ``preemptions`` and ``preempted_tokens`` (cached tokens
    they discarded, recomputed on re-admission), the ``kv_allocation`` policy, ``max_waiting``."""
    scheduler = engine.scheduler
    return {
        "kv_allocation": "whole_request" if scheduler.whole_request else "on_demand",
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
        "max_waiting": scheduler.max_waiting,
        "kv_blocks_used": engine.blocks.used_blocks,
        **scheduler.stats,
    }


def speculative_report(engine) -> dict:
    """The configuration (``method``, ``tokens`` = k; ``None``/0 when off), the acceptance
    statistics (:class:`~dcpgraph.runtime.acceptance.AcceptanceStats`) and, with a draft
    model, the draft's steps per graph."""
    out = {"method": engine.speculative.method if engine.speculative else None, "tokens": engine.speculative_tokens,
           **(engine.speculative.describe() if engine.speculative else {}), **engine.scheduler.acceptance.report()}
    draft_runner = getattr(engine.runner.proposer, "runner", None)
    if draft_runner is not None:
        out["draft_graph_steps"] = dict(draft_runner.graph_steps)
    if engine.runner.rollback:  # recurrent state restored and replayed after rejected drafts
        out["state_replays"] = dict(engine.runner.replays)
    return out


def engine_report(engine) -> dict:
    """What ran where: the DCP lowering (and, for ``comm="auto"``, the predicted costs it was
    chosen by), per graph the backend used and any fallback with its reason, the decode
    buckets, how many steps each graph served, speculation, the scheduler (preemptions) and the
    prefix cache."""
    backend = engine.graphs.report() if engine.graphs is not None else {"backend": "eager", "graphs": {}}
    return {
        "executor": engine.executor.mode,
        "mesh": str(engine.mesh),
        "comm": engine.program.lowering.comm,
        "comm_choice": engine.program.lowering.comm_choice,  # why comm="auto" chose it (None: not auto)
        "steps": engine.steps,
        "graph_steps": dict(engine.runner.graph_steps),
        "dummy_steps": engine.runner.dummy_steps,  # forwards with no work (data-parallel replicas sharing experts)
        "decode_buckets": list(engine.runner.buckets.sizes) if engine.runner.buckets else [],
        "speculative": speculative_report(engine),
        "scheduler": scheduler_report(engine),
        "prefix_cache": prefix_cache_report(engine),
        **backend,
    }
