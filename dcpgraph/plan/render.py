"""A :class:`~.planner.Plan` as a console table (thousands separators) or as JSON."""

from __future__ import annotations

import json

from .planner import Plan, PlanRow
from .prefill_plan import PrefillRow

GIB = 2**30

COLUMNS = ("tp", "dcp", "repl", "nodes", "intlv", "comm", "kv dtype", "weights GiB/rank", "KV GiB/rank",
           "KV B/token/rank", "blocks", "KV tokens", "max conc", "batch", "attn ms", "coll ms",
           "coll B/layer", "step ms", "tok/s", "note")


def _cells(row: PlanRow, recommended: PlanRow | None) -> list[str]:
    head = [f"{row.tp}", f"{row.dcp}", f"{row.replicas}", f"{row.nodes}", f"{row.interleave}", row.comm,
            row.kv_cache_dtype]
    if not row.valid:
        return head + [""] * 12 + [f"INVALID: {row.rule}"]
    cells = head + [f"{row.weight_bytes_per_rank / GIB:,.1f}", f"{row.kv_budget_bytes_per_rank / GIB:,.1f}",
                    f"{row.kv_bytes_per_token:,.0f}" if row.kv_bytes_per_token == int(row.kv_bytes_per_token)
                    else f"{row.kv_bytes_per_token:,.1f}"]
    blocks = f"{row.num_blocks:,}" if row.bytes_per_block else "-"  # DeepSeek-V4's caches are not paged
    if row.rule:
        return cells + [blocks, f"{row.capacity_tokens:,}"] + [""] * 7 + [f"DOES NOT FIT: {row.rule}"]
    c = row.cost
    cells += [blocks, f"{row.capacity_tokens:,}", f"{row.max_concurrency:,}", f"{row.batch:,}",
              f"{c.attention_s * 1e3:,.2f}", f"{c.collective_s * 1e3:,.2f}", f"{c.collective_bytes_per_layer:,}",
              f"{c.step_s * 1e3:,.2f}", f"{row.tokens_per_s:,.0f}"]
    return cells + ["<- recommended" if row is recommended else ""]


PREFILL_COLUMNS = ("tp", "pcp", "repl", "nodes", "tokens/rank", "compute ms", "K/V exchange ms", "all-reduce ms",
                   "TTFT ms", "vs pcp=1", "note")


def _prefill_cells(row: PrefillRow, recommended: PrefillRow | None) -> list[str]:
    head = [f"{row.tp}", f"{row.pcp}", f"{row.replicas}", f"{row.nodes}"]
    if not row.valid:
        return head + [""] * 6 + [f"INVALID: {row.rule}"]
    e = row.estimate
    note = f"DOES NOT FIT: {row.rule}" if row.rule else "<- fastest first token" if row is recommended else ""
    return head + [f"{e.tokens_per_rank:,}", f"{e.compute_s * 1e3:,.2f}", f"{e.exchange_s * 1e3:,.2f}",
                   f"{e.allreduce_s * 1e3:,.2f}", f"{e.ttft_s * 1e3:,.2f}",
                   f"{row.speedup:.2f}x" if row.speedup else "-",
                   note]


def _aligned(columns: tuple[str, ...], cells: list[list[str]]) -> list[str]:
    rows = [list(columns)] + cells
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns) - 1)]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]


def _world(p: Plan) -> str:
    """``"8 x h200"``, or over nodes ``"16 = 2 nodes x 8 h200"``."""
    if p.nnodes > 1:
        return f"{p.world_size} = {p.nnodes} nodes x {p.gpus_per_node} {p.hardware.name}"
    return f"{p.world_size} x {p.hardware.name}"


def render_table(p: Plan) -> str:
    m = p.model
    lines = [
        f"model {m.name}: {m.attention.upper()}, {m.num_layers} layers, {m.num_q_heads} query heads, "
        f"{m.num_kv_heads} KV head(s), cache dims {m.head_dim}/{m.v_head_dim}",
        f"world {_world(p)}, block_size {p.block_size}, max_model_len {p.max_model_len:,}, "
        f"workload: context {p.context_len:,}, concurrency "
        + (f"{p.concurrency:,}" if p.concurrency else "as many as fit"),
        "",
    ]
    lines += _aligned(COLUMNS, [_cells(r, p.recommended) for r in p.rows])
    lines += ["", f"recommendation: {p.reason}"]
    if p.prefill_rows:
        lines += ["", f"prefill: time to first token of one {p.prompt_len:,}-token prompt (tp x pcp ranks per replica)", ""]
        lines += _aligned(PREFILL_COLUMNS, [_prefill_cells(r, p.prefill_recommended) for r in p.prefill_rows])
    lines += ["", "assumptions:"] + [f"  - {a}" for a in p.assumptions]
    lines.append("  - attention time = max(KV bytes read per rank / memory bandwidth, FLOPs / compute) per layer"
                 if p.hardware.compute_overlaps_memory else
                 "  - attention time = KV bytes read per rank / bandwidth + FLOPs / compute rate (measured)")
    return "\n".join(lines)


def plan_dict(p: Plan) -> dict:
    return {
        "model": p.model.__dict__, "hardware": p.hardware.__dict__, "world_size": p.world_size,
        "nnodes": p.nnodes, "gpus_per_node": p.gpus_per_node,
        "block_size": p.block_size, "max_model_len": p.max_model_len, "context_len": p.context_len,
        "concurrency": p.concurrency, "rows": [r.as_dict() for r in p.rows],
        "recommended": p.rows.index(p.recommended) if p.recommended is not None else None,
        "reason": p.reason, "assumptions": p.assumptions,
        "prompt_len": p.prompt_len, "prefill_rows": [r.as_dict() for r in p.prefill_rows],
        "prefill_recommended": (p.prefill_rows.index(p.prefill_recommended)
                                if p.prefill_recommended is not None else None),
    }


def render_json(p: Plan) -> str:
    return json.dumps(plan_dict(p), indent=2)
