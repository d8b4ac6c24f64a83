"""Capacity of a Qwen3.5-shaped hybrid (3 gated-delta-net layers : 1 full-attention layer) against
a same-size all-attention model, per rank, at 32K and 128K tokens of context and dcp 1/2/4/8.

Shape: transformers' ``Qwen3_5TextConfig()`` defaults (32 layers, 24 gated delta nets with 16 key /
32 value heads of 128 and conv kernel 4, 8 gated attention layers with 16 query / 4 KV heads of
256), bf16. The all-attention model is the same config with every layer ``full_attention``.
The model is built once on the meta device (no weights) to check that the planner's shape has the
layers and dims transformers builds; every figure comes from :func:`dcpgraph.plan.plan` (the KV per-block formula of
:mod:`dcpgraph.capacity`, the state of :mod:`dcpgraph.recurrent_state`, the engine's rule that the
state pools come out of the budget before the KV blocks), and one small case is cross-checked
against a compiled engine's ``memory_report()`` (a 4-layer Qwen3.5-shaped model at tp2·dcp2).

Per (context, tp, dcp) with tp 4, 8, 16 and every dcp they allow (``dcp ≤ tp / 4`` KV heads; tp
must divide the 16 query heads, so dcp 8, which needs tp 32, is listed as refused with the rule):
KV bytes and state bytes per request per rank, their sum against the all-attention model's KV,
and the most requests that fit a 64 GiB per-rank budget for each.

    python3 benchmarks/hybrid_capacity.py [--skip-engine-check]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import transformers  # noqa: E402

from dcpgraph import capacity  # noqa: E402
from dcpgraph.errors import ConfigError  # noqa: E402
from dcpgraph.mesh import Mesh  # noqa: E402
from dcpgraph.plan import load_model_shape, plan  # noqa: E402

NAME = "hybrid_capacity"
BUDGET = 64 << 30  # KV + state bytes per rank
BLOCK = 16
CONTEXTS = (32768, 131072)
MESHES = ((4, 1), (8, 1), (8, 2), (16, 1), (16, 2), (16, 4), (32, 8))  # (tp, dcp); dcp <= tp / 4 KV heads


def qwen3_5_config(all_attention: bool = False) -> dict:
    config = transformers.Qwen3_5TextConfig().to_dict()
    config["torch_dtype"] = "bfloat16"
    if all_attention:
        config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    return config


def meta_model_layers() -> dict:
    """The default Qwen3.5 built on the meta device (no weights): its gated delta net and
    attention layers counted from the modules, and the first gated delta net's dims, so the
    config-derived shape is checked against what transformers builds."""
    import torch

    with torch.device("meta"):
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig())
    layers = model.model.layers
    gdn = next(layer.linear_attn for layer in layers if hasattr(layer, "linear_attn"))
    attention = next(layer.self_attn for layer in layers if hasattr(layer, "self_attn"))
    return {"gated_delta_net_layers": sum(hasattr(layer, "linear_attn") for layer in layers),
            "attention_layers": sum(hasattr(layer, "self_attn") for layer in layers),
            "gdn_dims": (gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim, gdn.conv_kernel_size),
            "kv_proj_rows": attention.k_proj.weight.shape[0]}


def mesh_rule(config: dict, tp: int, dcp: int) -> str:
    """``Mesh.validate``'s message for (tp, dcp) with the model's heads, or "" where it is valid."""
    try:
        Mesh(tp, dcp).validate(attention="gqa", num_q_heads=config["num_attention_heads"],
                               num_kv_heads=config["num_key_value_heads"], block_size=BLOCK)
    except ConfigError as err:
        return str(err)
    return ""


def row_of(config: dict, tp: int, dcp: int, context: int):
    p = plan(config, world_size=tp, kv_cache_memory_bytes=BUDGET, block_size=BLOCK, max_model_len=context,
             context_len=context, hardware="h200")
    return next(r for r in p.rows if (r.tp, r.dcp, r.interleave) == (tp, dcp, 1) and r.comm in ("none", "a2a"))


def per_request(row, context: int, dcp: int) -> int:
    """KV bytes one request of ``context`` tokens holds on a rank (whole virtual blocks)."""
    return capacity.blocks_for_tokens(context, BLOCK, dcp) * row.bytes_per_block


def engine_check() -> dict:
    """A compiled 4-layer Qwen3.5-shaped hybrid (3 gated delta nets, 1 attention layer, one KV head)
    at tp2·dcp2: its ``memory_report()`` against the plan's per-rank figures for the same config."""
    import torch

    import dcpgraph
    from dcpgraph.kv_budget import kv_bytes_per_block

    config = transformers.Qwen3_5TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"])
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    engine = dcpgraph.compile(dcpgraph.trace(model), tp=2, dcp=2, block_size=4, num_blocks=16, max_num_seqs=3,
                              capture_limit=0)
    report = engine.memory_report()
    row = next(r for r in plan({**config.to_dict(), "torch_dtype": "float32"}, world_size=2,
                               kv_cache_memory_bytes=1 << 20, block_size=4, max_model_len=64, hardware="h200").rows
               if (r.tp, r.dcp, r.interleave) == (2, 2, 1) and r.valid)
    return {"engine_state_bytes_per_request": report["recurrent_state_bytes_per_request"],
            "plan_state_bytes_per_request": row.state_bytes_per_request,
            "engine_state_bytes_per_rank": report["recurrent_state_bytes_per_rank"][0],
            "engine_kv_bytes_per_block": kv_bytes_per_block(engine.program), "plan_kv_bytes_per_block": row.bytes_per_block}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-engine-check", action="store_true", help="no compiled engine (formulas only)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    hybrid, dense = qwen3_5_config(), qwen3_5_config(all_attention=True)
    records, lines = [], []
    header = (f"{'context':>8} {'tp':>3} {'dcp':>3} {'KV MiB/req':>11} {'state MiB/req':>13} {'hybrid MiB/req':>14} "
              f"{'all-attn MiB/req':>16} {'bytes ratio':>11} {'hybrid conc':>11} {'all-attn conc':>13} {'conc ratio':>10}")
    for context in CONTEXTS:
        for tp, dcp in MESHES:
            refused = mesh_rule(hybrid, tp, dcp)
            config = f"ctx={context} tp={tp} dcp={dcp}"
            if refused:
                lines.append(f"{context:>8} {tp:>3} {dcp:>3}  refused: {refused}")
                records.append(common.record(NAME, config, "refused", 0, "", rule=refused))
                continue
            h, d = row_of(hybrid, tp, dcp, context), row_of(dense, tp, dcp, context)
            kv, state = per_request(h, context, dcp), h.state_bytes_per_request
            dense_kv = per_request(d, context, dcp)
            config = f"ctx={context} tp={tp} dcp={dcp} bf16 budget=64GiB/rank"
            records += [
                common.record(NAME, config, "hybrid_kv_bytes_per_request_per_rank", kv, "B"),
                common.record(NAME, config, "hybrid_state_bytes_per_request_per_rank", state, "B"),
                common.record(NAME, config, "hybrid_bytes_per_request_per_rank", kv + state, "B", baseline=dense_kv),
                common.record(NAME, config, "hybrid_max_concurrency", h.max_concurrency, "requests",
                              baseline=d.max_concurrency),
            ]
            mib = 2**20
            lines.append(f"{context:>8} {tp:>3} {dcp:>3} {kv / mib:>11.1f} {state / mib:>13.2f} {(kv + state) / mib:>14.1f} "
                         f"{dense_kv / mib:>16.1f} {(kv + state) / dense_kv:>11.3f} {h.max_concurrency:>11,} "
                         f"{d.max_concurrency:>13,} {h.max_concurrency / d.max_concurrency:>10.2f}")
    print(header)
    print("\n".join(lines))
    meta = meta_model_layers()
    shape = load_model_shape(hybrid)
    g = shape.gated_delta_net
    built = (meta["gated_delta_net_layers"], meta["attention_layers"], meta["gdn_dims"], meta["kv_proj_rows"])
    planned = (shape.recurrent_layers, shape.attention_layers,
               (g.key_heads, g.value_heads, g.key_dim, g.value_dim, g.conv_kernel), shape.num_kv_heads * shape.head_dim)
    print(f"meta-device Qwen3.5 (layers, dims) {built} vs the planner's shape {planned}")
    records.append(common.with_target(
        common.record(NAME, "Qwen3_5TextConfig() on meta", "meta_model_matches_plan_shape", int(built == planned), "bool",
                      built=str(built), planned=str(planned)),
        "the planner's shape has the layers and dims transformers builds", built == planned, "they differ"))
    if not args.skip_engine_check:
        check = engine_check()
        agree = (check["engine_state_bytes_per_request"] == check["plan_state_bytes_per_request"]
                 and check["engine_kv_bytes_per_block"] == check["plan_kv_bytes_per_block"])
        print(f"engine cross-check (tiny Qwen3.5 shape, tp2·dcp2, fp32): {check} -> {'agree' if agree else 'DIFFER'}")
        records.append(common.with_target(
            common.record(NAME, "tiny qwen3_5 tp=2 dcp=2 fp32", "plan_equals_memory_report", int(agree), "bool", **check),
            "plan's state and KV bytes per rank equal the compiled engine's memory_report()", agree,
            "the plan's formulas and the compiled program disagree"))
    return common.finish(NAME, records, start)


if __name__ == "__main__":
    raise SystemExit(main())
