"""KV capacity of sliding/full hybrid models: per-layer-group sizing vs uniform sizing.

With uniform sizing every layer keeps one block per virtual block of every request, so a sliding
layer's cache is as large as a full layer's. With ``hybrid_kv_cache=True`` (see
:mod:`dcpgraph.runtime.layer_groups`) a sliding layer keeps only its window: the sliding group's
pool holds ``max_num_seqs`` windows plus one step's tokens, and the rest of the budget goes to
the full layers. Two production shapes at full depth (tiny hidden / vocab sizes: the cache
depends only on layers, KV heads, head dims, windows and dtype), bf16:

* Gemma-3-27B-shaped: 62 layers, 5 sliding (window 1024) : 1 full, 32 query / 16 KV heads,
  head_dim 128; tp=8 (2 KV heads per rank; dcp must be 1: DCP needs ``tp > kv heads``).
* GPT-OSS-120B-shaped: 36 layers alternating sliding (window 128) / full, 64 query / 8 KV heads,
  head_dim 64, attention sinks; tp=8 (1 KV head per rank, dcp 1).
* Qwen3-shaped hybrid (to show it composes with DCP): 48 layers, 3 sliding (window 4096) : 1 full,
  64 query / 4 KV heads, head_dim 128; tp=8, dcp ∈ {1, 2}.

Nothing runs: each configuration is compiled with ``num_blocks=1``; the per-rank budget (16 GiB)
is divided by ``blocks_for_budget`` — what ``compile(kv_cache_bytes_per_rank=)`` uses — for both
sizings. Records per config, hybrid against uniform: ``concurrent_requests`` (the most requests of
``--context`` tokens that fit: for the hybrid, the largest ``N`` whose sliding pool, sized for
``max_num_seqs=N``, leaves full-group blocks for ``N`` such requests) and ``kv_bytes_per_token``
(per rank, at that context, all layers). Target: hybrid capacity ≥ uniform (rows also give the
closed-form bound ``(L_full + L_sliding) / L_full`` the ratio approaches as context ≫ window).

    python3 benchmarks/kv_capacity_hybrid.py [--quick] [--context 32768]

``--quick`` uses one pattern period of each model (6, 2 and 4 layers: same ratio of sliding to
full layers) and the default context.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import torch  # noqa: E402

import dcpgraph  # noqa: E402
from dcpgraph.capacity import max_sequences  # noqa: E402
from dcpgraph.runtime.engine import blocks_for_budget  # noqa: E402

NAME = "kv_capacity_hybrid"
BUDGET = 16 << 30  # bytes per rank
TP = 8
BLOCK = 16
STEP_TOKENS = 2048  # max_num_batched_tokens
DTYPE = torch.bfloat16
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=64, tie_word_embeddings=False,
             max_position_embeddings=1 << 18)


def _pattern(layers: int, period: int) -> list[str]:
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]


def gemma3_27b_like(layers: int):
    import transformers as tf

    return tf.Gemma3TextConfig(num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=16,
                               head_dim=128, sliding_window=1024, layer_types=_pattern(layers, 6),
                               query_pre_attn_scalar=128, **SMALL)


def gpt_oss_120b_like(layers: int):
    import transformers as tf

    return tf.GptOssConfig(num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                           sliding_window=128, layer_types=_pattern(layers, 2), num_local_experts=4,
                           num_experts_per_tok=2, **SMALL)


def qwen3_hybrid_like(layers: int):
    import transformers as tf

    return tf.Qwen3Config(num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                          use_sliding_window=True, sliding_window=4096, layer_types=_pattern(layers, 4), **SMALL)


GPT_OSS_PLAN = {f"model.layers.*.self_attn.{p}": s for p, s in
                (("q_proj", "colwise"), ("k_proj", "colwise"), ("v_proj", "colwise"), ("o_proj", "rowwise"),
                 ("sinks", "colwise"))}
MODELS = {
    # name: (config factory, full layers, quick layers, dcp values, compile options)
    "gemma3-27b-like": (gemma3_27b_like, 62, 6, (1,), {}),
    "gpt-oss-120b-like": (gpt_oss_120b_like, 36, 2, (1,), {"plan": GPT_OSS_PLAN}),
    "qwen3-hybrid-like": (qwen3_hybrid_like, 48, 4, (1, 2), {}),
}


def _engine(program, dcp: int, hybrid: bool, options: dict):
    return dcpgraph.compile(program, tp=TP, dcp=dcp, block_size=BLOCK, num_blocks=1, backend="eager", capture_limit=0,
                            verify=False, max_num_seqs=1, hybrid_kv_cache=hybrid, **options)


def hybrid_concurrency(program, context: int, dcp: int) -> tuple[int, int]:
    """``(N, full blocks)``: the most requests of ``context`` tokens whose sliding pool (sized for
    ``max_num_seqs=N``) and full-group blocks both fit the budget."""
    best = (0, 0)
    n = 1
    while True:
        blocks = blocks_for_budget(program, kv_cache_bytes_per_rank=BUDGET, max_model_len=context, max_num_seqs=n,
                                   decode_tokens=1, step_tokens=STEP_TOKENS)
        if max_sequences(blocks, context, BLOCK, dcp) < n:
            return best
        best, n = (n, blocks), n + 1


def run_model(name: str, layers: int, context: int) -> list[dict]:
    factory, _, _, dcps, options = MODELS[name]
    import transformers as tf

    config = factory(layers)
    torch.manual_seed(0)
    program = dcpgraph.trace(tf.AutoModelForCausalLM.from_config(config).to(DTYPE).eval())
    sliding = sum(t == "sliding_attention" for t in config.layer_types)
    bound = layers / (layers - sliding)
    records = []
    for dcp in dcps:
        t0 = time.perf_counter()
        uniform = _engine(program, dcp, False, options)
        hybrid = _engine(program, dcp, True, options)
        u_blocks = blocks_for_budget(uniform.program, kv_cache_bytes_per_rank=BUDGET, max_model_len=context,
                                     max_num_seqs=1)
        u_requests = max_sequences(u_blocks, context, BLOCK, dcp)
        h_requests, h_blocks = hybrid_concurrency(hybrid.program, context, dcp)
        per_block = uniform.memory_report()["kv_bytes_per_rank"][0]  # one block of every cache
        tokens_per_block = BLOCK * dcp
        u_per_token = per_block / tokens_per_block
        h_per_token = BUDGET / (h_requests * context) if h_requests else float("inf")
        config_name = (f"{name} L={layers} ({sliding} sliding, window {config.sliding_window}) tp={TP} dcp={dcp} "
                       f"bf16 block={BLOCK} context={context} budget=16GiB/rank")
        print(f"  {config_name}: uniform {u_requests} requests ({u_blocks} blocks), hybrid {h_requests} requests "
              f"({h_blocks} full blocks); compiled in {time.perf_counter() - t0:.1f} s")
        r1 = common.record(NAME, config_name, "concurrent_requests", h_requests, "requests",
                           baseline=u_requests, ratio=h_requests / u_requests if u_requests else float("nan"),
                           closed_form_bound=round(bound, 4))
        common.with_target(r1, "hybrid >= uniform, at most the (L_full + L_sliding) / L_full bound",
                           u_requests <= h_requests <= bound * u_requests + 1,
                           f"hybrid {h_requests} vs uniform {u_requests} (bound ×{bound:.3f})")
        r2 = common.record(NAME, config_name, "kv_bytes_per_token", h_per_token, "B/token/rank",
                           baseline=u_per_token, ratio=h_per_token / u_per_token)
        records += [r1, r2]
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one pattern period per model instead of full depth")
    parser.add_argument("--context", type=int, default=32768, help="tokens per request")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    records = []
    for name, (_, full, quick, _, _) in MODELS.items():
        records += run_model(name, quick if args.quick else full, args.context)
    common.print_records(records)
    met = [r["met"] for r in records if "target" in r]
    print(f"targets: {sum(met)}/{len(met)} met (hybrid capacity >= uniform, within the closed-form bound)")
    out = common.write(NAME, records)
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
