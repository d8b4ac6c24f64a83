"""fp8 vs bf16 KV cache: bytes per token, and teacher-forced next-token agreement.

One run measures, on the same model and weights:

* KV bytes per token of context (``Engine.memory_report()``, scale bytes included) with
  ``kv_cache_dtype="fp8_e4m3"`` vs ``"bf16"``, for a GQA model with head_dim 128 and for the
  DeepSeek-V3 latent (576 = 512 + 64) shape from the planner (target: ≤ 0.55×);
* teacher-forced next-token agreement of the fp8-KV engine with the bf16-KV engine over
  ``--positions`` (1,000) positions of a tiny model, with the max and mean absolute logit error
  (target: ≥ 99%). The model is a 2-layer Qwen3 shape (hidden 128, 4 query / 2 KV heads of 128)
  trained here for 900 steps (cosine-decayed rate) on an order-2 Markov source (the next token is a fixed
  function of the previous two with probability 0.9), so that its predictions depend on attention
  and have the margins of a model that learned something; its last 300 steps train on sequences
  as long as the measured context, so no measured position is past the length it was trained at.
  Without a target, alongside: a stress control (the same model trained on 64-token sequences
  only, whose margins collapse past that length) and a random-weight model's near-ties
  (DeepSeek-V3 MLA shape).

Both engines run with ``max_num_batched_tokens=1``: every position is its own step and reads all
earlier positions from the cache under test.

Where the disagreements are: each disagreeing position's margin (top-1 minus top-2 logit of the
bf16-cache run) against the margin distribution of all positions, and two controls on the same
trained weights and tokens: the bf16 model (bf16 cache) against the fp32 model (fp32 cache), i.e.
how often bf16 arithmetic alone flips the argmax, and fp8 against an fp32 cache on the fp32 model
(the cache's quantisation without bf16 activations).
"""

from __future__ import annotations

import argparse
import sys
import time

import common  # noqa: F401 - puts the checkout on sys.path
import torch

import dcpgraph
from dcpgraph.capacity import bytes_per_block
from dcpgraph.models import build_model, tiny_config
from dcpgraph.plan.model_shape import from_config
from dcpgraph.testing.generation import teacher_forced_logits

NAME = "kv_dtype"
ALPHABET = 16  # tokens the Markov source uses (ids 1..16)


def markov_source(seed: int):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(1, ALPHABET + 1, (ALPHABET + 1, ALPHABET + 1), generator=gen)

    def sample(batch: int, length: int, g: torch.Generator) -> torch.Tensor:
        out = torch.randint(1, ALPHABET + 1, (batch, length), generator=g)
        for t in range(2, length):
            follow = torch.rand(batch, generator=g) < 0.9
            out[:, t] = torch.where(follow, table[out[:, t - 2], out[:, t - 1]], out[:, t])
        return out

    return sample


def trained_model(steps: int, context: int, seed: int = 0):
    """The 2-layer Qwen3 trained on the Markov source: the first two thirds of the steps on batches
    of 32 × 64 tokens (the transition table is learnt fast there), the last third on batches of
    2 × ``context`` tokens, so every position the agreement is measured at is one the model was
    trained at. (Trained on 64-token sequences only, its margins collapsed past its trained length:
    no margin under 0.6 logit before position 256, 7.4% of them from 512 to 1,000, and those
    near-ties were where the caches disagreed.)"""
    import transformers as tf

    config = tf.Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                            max_position_embeddings=max(2048, context + 16), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config).float().train()
    sample = markov_source(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # Cosine decay to zero: the last steps settle the weights instead of hopping at the peak rate.
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    loss = None
    short_steps = (2 * steps) // 3
    for step in range(steps):
        batch = sample(32, 64, gen) if step < short_steps else sample(2, context, gen)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
    return model.eval(), sample, float(loss.detach())


def forced_logits(model, tokens: list[int], tp: int, dcp: int, kv: str) -> torch.Tensor:
    engine = dcpgraph.compile(model, tp=tp, dcp=dcp, block_size=16, max_num_batched_tokens=1,
                              max_model_len=len(tokens) + 8, kv_cache_dtype=kv)
    return teacher_forced_logits(engine, tokens).float(), engine


def agreement(model, tokens: list[int], tp: int, dcp: int, base_kv: str = "bf16") -> dict:
    (base, base_engine), (fp8, fp8_engine) = (forced_logits(model, tokens, tp, dcp, kv) for kv in (base_kv, "fp8_e4m3"))
    engines = {base_kv: base_engine, "fp8_e4m3": fp8_engine}
    err = (fp8 - base).abs()
    top2 = base.topk(2, -1).values
    margin = top2[:, 0] - top2[:, 1]
    differ = fp8.argmax(-1) != base.argmax(-1)
    return {
        "logits": base,
        "disagreement_margins": sorted(round(float(m), 4) for m in margin[differ]),
        "margin_quantiles": {q: round(float(torch.quantile(margin, q)), 4) for q in (0.01, 0.05, 0.5)},
        # Share of near-ties (margin < 0.6 logit) per quarter of the positions: where a cache's
        # rounding can flip the argmax at all.
        "near_tie_share_by_quarter": [round(float((part < 0.6).float().mean()), 4) for part in margin.chunk(4)],
        "agreement": float((fp8.argmax(-1) == base.argmax(-1)).float().mean()),
        "max_logit_error": float(err.max()), "mean_logit_error": float(err.mean()),
        "logit_scale": float(base.abs().max()),
        "bytes_per_token": {kv: e.memory_report()["kv_bytes_per_token"] for kv, e in engines.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=1000)
    parser.add_argument("--train-steps", type=int, default=900)
    parser.add_argument("--quick", action="store_true", help="200 positions, 150 training steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.positions, args.train_steps = 200, 150
    torch.set_num_threads(1)
    start = time.perf_counter()
    records = []
    cfg = f"{common.load_note()}"

    model, sample, loss = trained_model(args.train_steps, args.positions)
    records.append(common.record(NAME, f"qwen3-2L-h128 trained {args.train_steps} steps (last third at {args.positions} tokens); {cfg}",
                                 "train_loss", loss, "nats"))
    tokens = sample(1, args.positions, torch.Generator().manual_seed(7))[0].tolist()
    bf16_model = model.to(torch.bfloat16)
    gqa = agreement(bf16_model, tokens, 1, 1)
    ratio = gqa["bytes_per_token"]["fp8_e4m3"] / gqa["bytes_per_token"]["bf16"]
    rec = common.record(NAME, "qwen3-2L, 2 KV heads of 128, tp=1", "kv_bytes_per_token_fp8",
                        gqa["bytes_per_token"]["fp8_e4m3"], "B", baseline=gqa["bytes_per_token"]["bf16"], ratio=ratio)
    records.append(common.with_target(rec, "fp8 ≤ 0.55× bf16", ratio <= 0.55, f"{ratio:.3f}×"))
    rec = common.record(NAME, f"qwen3-2L trained, {args.positions} positions, tp=1", "next_token_agreement",
                        gqa["agreement"], "fraction", max_logit_error=gqa["max_logit_error"],
                        mean_logit_error=gqa["mean_logit_error"], logit_scale=gqa["logit_scale"])
    records.append(common.with_target(rec, "≥ 0.99", gqa["agreement"] >= 0.99, f"{gqa['agreement']:.4f}"))
    margins = gqa["disagreement_margins"]
    records.append(common.record(NAME, f"qwen3-2L trained, {args.positions} positions, tp=1", "disagreement_margin_max",
                                 max(margins, default=0.0), "logit", margins=margins,
                                 all_positions_margin_quantiles=gqa["margin_quantiles"],
                                 near_tie_share_by_quarter=gqa["near_tie_share_by_quarter"]))
    fp32_model = bf16_model.to(torch.float32)
    control = agreement(fp32_model, tokens, 1, 1, base_kv="auto")
    bf16_vs_fp32 = float((gqa["logits"].argmax(-1) == control["logits"].argmax(-1)).float().mean())
    records.append(common.record(NAME, "control: bf16 model + bf16 cache vs fp32 model + fp32 cache (the same bf16-representable weights)",
                                 "next_token_agreement", bf16_vs_fp32, "fraction"))
    records.append(common.record(NAME, "control: fp32 model, fp8 cache vs fp32 cache", "next_token_agreement",
                                 control["agreement"], "fraction", max_logit_error=control["max_logit_error"],
                                 disagreement_margins=control["disagreement_margins"]))
    # Stress control, no target: the same model trained on 64-token sequences only, measured at the
    # same positions, most of them past the length it was trained at (its margins shrink there).
    short, _, _ = trained_model(args.train_steps, 64)
    stress = agreement(short.to(torch.bfloat16), tokens, 1, 1)
    records.append(common.record(NAME, f"stress control: trained on 64-token sequences only, {args.positions} positions, tp=1",
                                 "next_token_agreement", stress["agreement"], "fraction",
                                 max_logit_error=stress["max_logit_error"], disagreement_margins=stress["disagreement_margins"],
                                 near_tie_share_by_quarter=stress["near_tie_share_by_quarter"]))
    for key in ("max_logit_error", "mean_logit_error"):
        records.append(common.record(NAME, "qwen3-2L trained, tp=1", key, gqa[key], "logit",
                                     baseline=gqa["logit_scale"]))

    latent = from_config({**tiny_config("deepseek_v3").to_dict(), "kv_lora_rank": 512, "qk_rope_head_dim": 64})
    planned = {kv: bytes_per_block(latent.cache_shapes(1, kv), 1) for kv in ("bf16", "fp8_e4m3")}
    ratio = planned["fp8_e4m3"] / planned["bf16"]
    rec = common.record(NAME, "MLA latent 512+64 (planner = compiled formula)", "kv_bytes_per_token_fp8",
                        planned["fp8_e4m3"] / latent.num_layers, "B", baseline=planned["bf16"] / latent.num_layers,
                        ratio=ratio)
    records.append(common.with_target(rec, "fp8 ≤ 0.55× bf16", ratio <= 0.55, f"{ratio:.3f}×"))

    mla_positions = min(args.positions, 256)
    mla = build_model("deepseek_v3", dtype=torch.bfloat16)
    mla_tokens = torch.randint(1, 256, (mla_positions,), generator=torch.Generator().manual_seed(3)).tolist()
    res = agreement(mla, mla_tokens, 2, 2)
    records.append(common.record(NAME, f"deepseek_v3 tiny, random weights, {mla_positions} positions, tp=2 dcp=2",
                                 "next_token_agreement", res["agreement"], "fraction",
                                 max_logit_error=res["max_logit_error"], mean_logit_error=res["mean_logit_error"],
                                 logit_scale=res["logit_scale"]))
    return common.finish(NAME, records, start)


if __name__ == "__main__":
    sys.exit(main())
