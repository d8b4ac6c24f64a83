"""Decode step time does not depend on the allocated KV-cache capacity.

The same model and prompt are served by engines whose caches differ only in size (``num_blocks``
64 vs 4096, i.e. 64× the memory). After prefill, each engine's ``step()`` decodes one token of
the one running request; the median decode step time should be the same for both (a kernel that
touched the whole cache, or a cache write that copied it, would scale with ``num_blocks``).

Runs tp=1/dcp=1 and tp=2/dcp=2 (SPMD emulator, one process), interleaving the two sizes round by
round so that machine noise hits both alike. Prints the medians and their ratio and writes
``benchmarks/results/decode_capacity.json`` (a list of records
``{"benchmark","config","metric","value","unit","baseline","ratio"}``; ``baseline`` is the
small-cache median of the same mesh, ``ratio`` = value / baseline). Under a minute on 2 cores::

    python3 benchmarks/decode_capacity.py [--steps 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import dcpgraph  # noqa: E402

SIZES = (64, 4096)  # num_blocks
MESHES = ((1, 1), (2, 2))
BLOCK_SIZE = 16
PROMPT_LEN = 96


def build_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=1, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.float32).eval()


def decode_times(engine, prompt: list[int], steps: int, warmup: int = 4) -> list[float]:
    """Seconds of each decode ``step()`` after the prompt is prefilled (one request)."""
    engine.add_request(prompt, steps + warmup + 1)
    while not engine.step():  # prefill (one step: the budget covers the prompt)
        pass
    times = []
    for i in range(steps + warmup):
        start = time.perf_counter()
        events = engine.step()
        elapsed = time.perf_counter() - start
        assert len(events) == 1, events
        if i >= warmup:
            times.append(elapsed)
    while engine.scheduler.has_work():
        engine.step()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=48, help="timed decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "decode_capacity.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    start = time.perf_counter()
    model = build_model()
    program = dcpgraph.trace(model)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 512, (PROMPT_LEN,), generator=gen).tolist()
    records = []
    for tp, dcp in MESHES:
        engines = {
            n: dcpgraph.compile(program, tp=tp, dcp=dcp, block_size=BLOCK_SIZE, num_blocks=n,
                                max_num_batched_tokens=256, max_num_seqs=1)
            for n in SIZES
        }
        samples: dict[int, list[float]] = {n: [] for n in SIZES}
        for _ in range(args.rounds):
            for n, engine in engines.items():
                samples[n] += decode_times(engine, prompt, args.steps)
        medians = {n: statistics.median(s) * 1e3 for n, s in samples.items()}
        baseline = medians[SIZES[0]]
        for n, engine in engines.items():
            mem = engine.memory_report()
            config = (f"llama-tiny fp32 tp={tp} dcp={dcp} block_size={BLOCK_SIZE} num_blocks={n} "
                      f"prompt={PROMPT_LEN} emulated")
            records.append({
                "benchmark": "decode_capacity", "config": config, "metric": "decode_step_median",
                "value": round(medians[n], 4), "unit": "ms", "baseline": round(baseline, 4),
                "ratio": round(medians[n] / baseline, 4),
            })
            print(f"tp={tp} dcp={dcp} num_blocks={n:5d} ({mem['kv_bytes_per_rank'][0] / 2**20:7.1f} MiB KV/rank, "
                  f"{mem['kv_capacity_tokens']:6d} tokens): median decode step {medians[n]:.3f} ms "
                  f"over {len(samples[n])} steps")
        print(f"tp={tp} dcp={dcp}: ratio {SIZES[-1]} / {SIZES[0]} blocks = "
              f"{medians[SIZES[-1]] / baseline:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=2) + "\n")
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
