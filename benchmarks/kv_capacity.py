"""Per-rank KV-cache bytes and capacity, TP only vs TP+DCP, read from compiled programs.

Two production shapes at their full layer count (tiny hidden / intermediate / vocab sizes and
few experts: the KV formula depends only on layers, KV heads, head dims and dtype), bf16:

* Qwen3-235B-A22B-shaped GQA: 94 layers, 64 query heads, 4 KV heads, head_dim 128; tp=8, so
  the 4 KV heads are replicated to 1 per rank; dcp ∈ {1, 2} (``(tp // kv_heads) % dcp == 0``).
* DeepSeek-V3-shaped MLA: 61 layers, 128 heads, kv_lora_rank 512 + rope 64 (one 576-wide latent
  per token and layer); tp=8, dcp ∈ {1, 2, 4, 8}.

Nothing runs: each configuration is compiled with ``num_blocks=1`` (``verify=False``: the
verifier does not change the program; ``compile_time`` measures it) and
``Engine.memory_report()`` gives the per-rank bytes of one block and the tokens it holds. The
capacity of a fixed per-rank budget (1 GiB) is ``blocks_for_budget(program,
kv_cache_bytes_per_rank=1 GiB)`` — the same function ``compile(kv_cache_bytes_per_rank=)`` uses —
times the tokens of a virtual block. Records per config: ``kv_bytes_per_token`` (per rank),
``kv_bytes_per_rank`` (one 128K-token sequence), ``kv_capacity_tokens`` (1 GiB per rank), each
against the dcp=1 value of the same model, and the closed form ``L·2·h_kv·D·b/dcp`` (GQA) or
``L·576·b/dcp`` (MLA). Targets: bytes exactly ``1/dcp`` of TP only, capacity exactly ``×dcp``.

``--quick`` uses 2 layers (same heads and dims): the ratios do not depend on the depth.

    python3 benchmarks/kv_capacity.py [--quick] [--layers N]
"""

from __future__ import annotations

import argparse
import sys
import time
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import torch  # noqa: E402

import dcpgraph  # noqa: E402
from dcpgraph.runtime.engine import blocks_for_budget  # noqa: E402

NAME = "kv_capacity"
BUDGET = 1 << 30  # bytes per rank
SEQ = 131072  # tokens of the reference sequence
TP = 8
BLOCK = 16
DTYPE = torch.bfloat16


def qwen3_235b_like(layers: int):
    import transformers as tf

    return tf.Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=64, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=1 << 18, tie_word_embeddings=False,
    )


def deepseek_v3_like(layers: int):
    import transformers as tf

    # qk_nope_head_dim / v_head_dim shrunk (they size the absorbed projections, not the cache).
    return tf.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=layers, num_attention_heads=128, num_key_value_heads=128,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=8, v_head_dim=8, q_lora_rank=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        n_group=1, topk_group=1, max_position_embeddings=1 << 18, tie_word_embeddings=False,
    )


MODELS = {
    # name: (config factory, full layers, dcp values, closed-form bytes per token per rank at dcp=1)
    "qwen3-235b-like": (qwen3_235b_like, 94, (1, 2), lambda L, b: L * 2 * 1 * 128 * b),
    "deepseek-v3-like": (deepseek_v3_like, 61, (1, 2, 4, 8), lambda L, b: L * (512 + 64) * b),
}


def build(config) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).to(DTYPE).eval()
    return model


def _num(x: Fraction):
    return int(x) if x.denominator == 1 else float(x)


def run_model(name: str, layers: int) -> list[dict]:
    factory, _, dcps, closed_form = MODELS[name]
    t0 = time.perf_counter()
    program = dcpgraph.trace(build(factory(layers)))
    print(f"{name}: traced {layers} layers in {time.perf_counter() - t0:.1f} s")
    b = torch.empty((), dtype=DTYPE).element_size()
    rows = {}
    for dcp in dcps:
        t0 = time.perf_counter()
        engine = dcpgraph.compile(program, tp=TP, dcp=dcp, block_size=BLOCK, num_blocks=1, backend="eager",
                                  capture_limit=0, verify=False, max_num_seqs=1)
        mem = engine.memory_report()
        per_block_rank = mem["kv_bytes_per_rank"][0]  # one physical block on every rank
        assert len(set(mem["kv_bytes_per_rank"])) == 1, mem
        per_token = Fraction(per_block_rank, mem["kv_capacity_tokens"])
        blocks = blocks_for_budget(engine.program, kv_cache_bytes_per_rank=BUDGET, max_model_len=SEQ, max_num_seqs=1)
        capacity = blocks * mem["virtual_block_tokens"]
        rows[dcp] = (per_token, capacity, mem)
        print(f"  tp={TP} dcp={dcp}: {float(per_token):.0f} B/token/rank, {capacity} tokens in 1 GiB/rank "
              f"({len(engine.program.caches)} caches; compiled in {time.perf_counter() - t0:.1f} s)")
    base_tok, base_cap, _ = rows[1]
    records = []
    for dcp, (per_token, capacity, _mem) in rows.items():
        config = f"{name} L={layers} tp={TP} dcp={dcp} bf16 block={BLOCK}"
        expect = Fraction(closed_form(layers, b), dcp)
        r1 = common.record(NAME, config, "kv_bytes_per_token", _num(per_token), "B/token/rank",
                           baseline=_num(base_tok), ratio=float(per_token / base_tok))
        ok = per_token == base_tok / dcp and per_token == expect
        common.with_target(r1, f"exactly 1/{dcp} of tp-only and = closed form {float(expect):.0f}", ok,
                           f"ratio {float(per_token / base_tok):.6f} vs {1 / dcp:.6f}; closed form {float(expect):.0f}")
        seq_bytes = per_token * SEQ
        r2 = common.record(NAME, config + f" seq={SEQ}", "kv_bytes_per_rank", _num(seq_bytes), "B",
                           baseline=_num(base_tok * SEQ), ratio=float(per_token / base_tok))
        common.with_target(r2, f"exactly 1/{dcp} of tp-only", per_token * dcp == base_tok,
                           f"ratio {float(per_token / base_tok):.6f} vs {1 / dcp:.6f}")
        r3 = common.record(NAME, config + " budget=1GiB/rank", "kv_capacity_tokens", capacity, "tokens",
                           baseline=base_cap, ratio=capacity / base_cap)
        common.with_target(r3, f"exactly ×{dcp} of tp-only", capacity == base_cap * dcp,
                           f"×{capacity / base_cap:.6f} instead of ×{dcp}")
        records += [r1, r2, r3]
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 layers instead of the full depth")
    parser.add_argument("--layers", type=int, default=None, help="override the depth of both models")
    parser.add_argument("--only-model", choices=sorted(MODELS), default=None)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    records = []
    for name, (_, full, _, _) in MODELS.items():
        if args.only_model and name != args.only_model:
            continue
        layers = args.layers or (2 if args.quick else full)
        records += run_model(name, layers)
    common.print_records(records)
    met = [r["met"] for r in records if "target" in r]
    print(f"targets: {sum(met)}/{len(met)} met (exact 1/dcp bytes, exact ×dcp capacity)")
    out = common.write(NAME, records)
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
