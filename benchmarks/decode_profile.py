"""Where an fp32 batched decode step's time goes, in process (the engine, not the server), on the
checkpoint shape of ``peer_vllm.py --quick`` (Qwen3, 4 layers, hidden 512, 8 / 2 heads of 64, MLP
1408, vocab 16,000: ~28M parameters, random weights).

Per batch: ``batch`` requests with ``--prompt``-token random prompts are prefilled, then
``--steps`` decode steps are timed (wall clock per ``engine.step()``) under ``torch.profiler``.
The step's time is split into: the fp32 linears (``dcpgraph::linear_f32`` and the ``aten::mm`` it
hands to torch beyond ``linear_f32.MAX_ROWS`` rows), paged attention, every other op (norms, rope,
residual adds, the activation, views and copies: self CPU time of the remaining ops), and what no
op accounts for (Python, scheduling, step inputs, sampling: the step's wall time minus all ops).
The profiler adds about a microsecond per op, which lands in the "other ops" share.

``--ab-rows R1 R2 ...``: instead, steps A/B over the native linear's row limit (the C++ rule and
``MAX_ROWS`` set before each pair of steps, the limits alternating in one process), median per limit.

``--ab-fuse``: instead, two engines on the same weights, ``fuse_linears`` on (A) and off (B),
stepped in alternation in one process: per batch the median decode step of each and B ÷ A, then
the median of ``--prefill-rounds`` single 2,048-token prefill chunks (one request's prompt, one
step) of each, alternating. ``--shape peer`` is ``peer_vllm.py``'s default ~125M-parameter
checkpoint shape (12 layers, hidden 768, 12 / 4 heads of 64, MLP 2048, vocab 32,000).

    python benchmarks/decode_profile.py [--batches 1 4 8 16] [--threads 1] [--ab-rows 8 32]
    python benchmarks/decode_profile.py --ab-fuse --shape peer --batches 1 4 8 16 32 --prompt 128
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_step  # noqa: E402
import torch  # noqa: E402

import dcpgraph  # noqa: E402
from dcpgraph.ops import linear_f32  # noqa: E402

SHAPE = dict(vocab_size=16000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64)
PEER = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
            num_attention_heads=12, num_key_value_heads=4, head_dim=64)
LINEAR_OPS = ("dcpgraph::linear_f32", "aten::mm", "aten::addmm")
PREFILL_CHUNK = 2048


def started_engine(program, batch: int, prompt: int, steps: int, **options):
    engine = dcpgraph.compile(program, backend="eager", max_num_seqs=batch, max_num_batched_tokens=prompt * batch,
                              max_model_len=prompt + steps + 16, kv_cache_tokens=(prompt + steps + 16) * batch,
                              **options)
    gen = torch.Generator().manual_seed(batch)
    for ids in torch.randint(0, program.facts.vocab_size, (batch, prompt), generator=gen).tolist():
        engine.add_request(ids, max_new_tokens=steps + 8)
    engine.step()  # prefill and the first token
    engine.step()
    return engine


def set_rows(rows: int) -> None:
    linear_f32.MAX_ROWS = rows
    linear_f32.EXTENSION.module.configure(True, rows)


def breakdown(program, batch: int, prompt: int, steps: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    engine = started_engine(program, batch, prompt, steps)
    wall = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            wall.append(time.perf_counter() - t0)
    self_us = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    linear = sum(self_us.get(k, 0.0) for k in LINEAR_OPS) / steps / 1e3
    attention = self_us.get("dcpgraph::paged_attention", 0.0) / steps / 1e3
    ops = sum(self_us.values()) / steps / 1e3
    step = sum(wall) / steps * 1e3
    parts = {"linears": linear, "attention": attention, "other ops": ops - linear - attention, "no op": step - ops}
    print(f"batch {batch}: step {step:.2f} ms (mean of {steps}, profiled); "
          + "; ".join(f"{k} {v:.2f} ms ({v / step:.0%})" for k, v in parts.items()), flush=True)


def ab_rows(program, batch: int, prompt: int, steps: int, limits: list[int]) -> None:
    engine = started_engine(program, batch, prompt, 2 * steps * len(limits))
    times: dict[int, list[float]] = {r: [] for r in limits}
    for _ in range(steps):
        for rows in limits:
            set_rows(rows)
            t0 = time.perf_counter()
            engine.step()
            engine.step()
            times[rows].append((time.perf_counter() - t0) / 2)
    med = {r: sorted(v)[len(v) // 2] * 1e3 for r, v in times.items()}
    first = med[limits[0]]
    print(f"batch {batch}: " + "; ".join(f"native ≤ {r} rows {m:.2f} ms ({m / first:.2f})" for r, m in med.items()),
          flush=True)


def _median_ms(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] * 1e3


def ab_fuse_decode(program, batch: int, prompt: int, steps: int) -> None:
    engines = {"fused": started_engine(program, batch, prompt, 2 * steps),
               "unfused": started_engine(program, batch, prompt, 2 * steps, fuse_linears=False)}
    times: dict[str, list[float]] = {k: [] for k in engines}
    for i in range(steps):
        for name in (list(engines) if i % 2 == 0 else list(engines)[::-1]):  # alternate who goes first
            t0 = time.perf_counter()
            engines[name].step()
            times[name].append(time.perf_counter() - t0)
    a, b = _median_ms(times["fused"]), _median_ms(times["unfused"])
    print(f"batch {batch}: decode step fused {a:.2f} ms, unfused {b:.2f} ms, unfused / fused {b / a:.3f}", flush=True)


def ab_fuse_prefill(program, rounds: int) -> None:
    chunk = PREFILL_CHUNK
    options = dict(backend="eager", max_num_seqs=1, max_num_batched_tokens=chunk, max_model_len=chunk + 16,
                   kv_cache_tokens=2 * (chunk + 16))
    engines = {"fused": dcpgraph.compile(program, **options),
               "unfused": dcpgraph.compile(program, fuse_linears=False, **options)}
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {k: [] for k in engines}
    for i in range(rounds + 1):  # the first round warms up, untimed
        ids = torch.randint(0, program.facts.vocab_size, (chunk,), generator=gen).tolist()
        for name in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
            engine = engines[name]
            engine.add_request(ids, max_new_tokens=1)
            t0 = time.perf_counter()
            engine.step()  # the whole prompt in one chunk, and its one token
            if i:
                times[name].append(time.perf_counter() - t0)
            while engine.scheduler.has_work():
                engine.step()
    a, b = _median_ms(times["fused"]), _median_ms(times["unfused"])
    print(f"prefill {chunk} tokens: fused {a:.1f} ms, unfused {b:.1f} ms, unfused / fused {b / a:.3f} "
          f"(median of {rounds})", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--ab-rows", type=int, nargs="+", default=None)
    p.add_argument("--ab-fuse", action="store_true")
    p.add_argument("--prefill-rounds", type=int, default=3)
    p.add_argument("--shape", choices=["quick", "peer"], default="quick")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    program = dcpgraph.trace(decode_step.build_model(PEER if args.shape == "peer" else SHAPE, torch.float32))
    if args.ab_fuse:
        print(f"shape {args.shape}, {args.threads} thread(s), prompt {args.prompt}, {args.steps} steps each",
              flush=True)
        for batch in args.batches:
            ab_fuse_decode(program, batch, args.prompt, args.steps)
        if args.prefill_rounds:
            ab_fuse_prefill(program, args.prefill_rounds)
        return 0
    if args.ab_rows and not linear_f32.native_enabled():
        print(f"native fp32 linear unavailable: {linear_f32.reason()}")
        return 1
    default_rows = linear_f32.MAX_ROWS
    for batch in args.batches:
        if args.ab_rows:
            ab_rows(program, batch, args.prompt, args.steps, args.ab_rows)
            set_rows(default_rows)
        else:
            breakdown(program, batch, args.prompt, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
