"""Decode throughput of the compiled engine (tp=1, dcp=1, eager backend) vs HF ``generate``.

Same model (a small Qwen3 in fp32: 4 layers, hidden 256, 4 query / 2 KV heads of 64, random
weights, no EOS so every request runs to ``max_new_tokens``), same machine, same process, one
thread; batch 1 and batch 8 (equal-length prompts, so HF needs no padding). HF runs
``model.generate(do_sample=False, use_cache=True)`` (its ``DynamicCache``); the engine runs
``engine.generate`` (prefill of the whole batch in one step, then one decode step per token).

Decode time per step is measured the same way for both, by subtraction: ``(T(N new tokens) −
T(1 new token)) / (N − 1)``, which removes prefill and per-call setup; tokens/s = batch / that.
End-to-end tokens/s (``batch·N / T(N)``) is recorded too. The four calls are interleaved round by
round; each one's minimum over the rounds counts. Clock: process CPU time (the machine is shared:
time preempted by other jobs does not count). The greedy tokens of both are compared.

Target: engine decode tokens/s ≥ HF's (ratio ≥ 1).

    python3 benchmarks/decode_tokens_per_s.py [--quick]
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

NAME = "decode_tokens_per_s"
PROMPT = 32
VOCAB = 1024


def build_model():
    import transformers as tf

    cfg = tf.Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=4096, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


GROUPS = {
    "paged_attention": ("dcpgraph::paged_attention",),
    "new_token_attention": ("dcpgraph::partial_attention",),
    "merge": ("dcpgraph::merge_attention",),
    "kv_cache_write": ("dcpgraph::kv_cache_write_",),
    "matmul": ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm"),
}


def profile_engine_step(engine, prompts, steps: int = 6) -> dict[str, float]:
    """Per decode step: ms in each op group (inclusive CPU time of the top-level ops), the rest
    of the graph's ops, and the engine's own Python (scheduling, inputs, sampling)."""
    from torch.profiler import ProfilerActivity, profile

    ids = [engine.add_request(p, steps + 2) for p in prompts]
    engine.step()  # prefill
    engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        c0 = time.process_time()
        for _ in range(steps):
            engine.step()
        total = (time.process_time() - c0) * 1e3 / steps
    while any(engine.scheduler.get(i) is not None for i in ids):  # finished requests are dropped
        engine.step()
    out = {g: 0.0 for g in GROUPS}
    ops = 0.0
    events = prof.events()
    for evt in events:
        if evt.cpu_parent is not None:  # only top-level ops: nested ones are inside their parents
            continue
        ms = evt.cpu_time_total / 1e3 / steps
        ops += ms
        for group, names in GROUPS.items():
            if evt.name in names:
                out[group] += ms
    out["other_ops"] = ops - sum(out.values())
    out["outside_ops"] = max(0.0, total - ops)
    out["total"] = total
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args(argv)
    new = args.new_tokens or (24 if args.quick else 64)
    rounds = args.rounds or (2 if args.quick else 4)
    torch.set_num_threads(1)
    start = time.perf_counter()
    model = build_model()
    program = dcpgraph.trace(model)
    engine = dcpgraph.compile(program, tp=1, dcp=1, backend="eager", max_num_seqs=max(args.batches),
                              max_num_batched_tokens=PROMPT * max(args.batches), max_model_len=PROMPT + new + 8,
                              kv_cache_tokens=(PROMPT + new + 16) * max(args.batches))
    gen = torch.Generator().manual_seed(0)
    records = []
    for batch in args.batches:
        prompts = torch.randint(0, VOCAB, (batch, PROMPT), generator=gen)
        mask = torch.ones_like(prompts)
        outputs = {}

        def hf(n, prompts=prompts, mask=mask, outputs=outputs):
            with torch.no_grad():
                out = model.generate(prompts, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                     use_cache=True, pad_token_id=0)
            outputs["hf"] = out[:, PROMPT:].tolist()

        def eng(n, prompts=prompts, outputs=outputs):
            outputs["engine"] = engine.generate(prompts.tolist(), max_new_tokens=n)

        fns = {"engine_N": lambda: eng(new), "engine_1": lambda: eng(1), "hf_N": lambda: hf(new), "hf_1": lambda: hf(1)}
        for fn in fns.values():  # warm-up (and the engine's first decode bucket)
            fn()
        best = {k: float("inf") for k in fns}
        for _ in range(rounds):
            for k, fn in fns.items():
                c0 = time.process_time()
                fn()
                best[k] = min(best[k], time.process_time() - c0)
        eng(new)
        hf(new)
        same = sum(a == b for ra, rb in zip(outputs["engine"], outputs["hf"]) for a, b in zip(ra, rb))
        total = batch * new
        step = {s: (best[f"{s}_N"] - best[f"{s}_1"]) / (new - 1) for s in ("engine", "hf")}
        tps = {s: batch / step[s] for s in step}
        e2e = {s: total / best[f"{s}_N"] for s in step}
        config = (f"qwen3 L=4 h=256 fp32 tp=1 dcp=1 eager batch={batch} prompt={PROMPT} new={new} threads=1 "
                  f"clock=cpu min-of-{rounds} greedy-match={same}/{total} {common.load_note()}")
        rec = common.record(NAME, config, "decode_tokens_per_s", tps["engine"], "tok/s", baseline=tps["hf"], digits=5)
        ratio = tps["engine"] / tps["hf"]
        common.with_target(rec, "≥ HF generate (ratio ≥ 1)", ratio >= 1.0,
                           f"{1 - ratio:.0%} slower than HF generate ({tps['engine']:.0f} vs {tps['hf']:.0f} tok/s)")
        records += [
            rec,
            common.record(NAME, config, "hf_decode_tokens_per_s", tps["hf"], "tok/s", digits=5),
            common.record(NAME, config, "decode_step_time", step["engine"] * 1e3, "ms", baseline=step["hf"] * 1e3, digits=4),
            common.record(NAME, config, "e2e_tokens_per_s", e2e["engine"], "tok/s", baseline=e2e["hf"], digits=5),
        ]
        breakdown = profile_engine_step(engine, prompts.tolist())
        for group, ms in breakdown.items():
            records.append(common.record(NAME, config, f"engine_step_ms:{group}", ms, "ms/step", digits=3))
        print(f"batch {batch}: engine decode step by op group (ms, torch.profiler): "
              + ", ".join(f"{k} {v:.2f}" for k, v in breakdown.items()))
        print(f"batch {batch}: engine {tps['engine']:.0f} tok/s ({step['engine'] * 1e3:.2f} ms/step), "
              f"HF {tps['hf']:.0f} tok/s ({step['hf'] * 1e3:.2f} ms/step): ratio {ratio:.2f}; "
              f"end-to-end {e2e['engine']:.0f} vs {e2e['hf']:.0f} tok/s; greedy tokens equal {same}/{total}")
    common.print_records(records)
    out = common.write(NAME, records)
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
