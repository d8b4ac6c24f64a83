"""Decode step time on a GPU with the decode buckets captured as CUDA graphs
(``cudagraph_mode="FULL_DECODE_ONLY"``, the default) and without (``"NONE"``: the same compiled
buckets, launched kernel by kernel); :mod:`dcpgraph.backends.device_graphs`.

One engine of each mode on the same traced model (tp=1, ``--backend``, default ``inductor``, what
``auto`` takes on CUDA; buckets up to the largest batch), per batch size:
``step = (T(N new tokens) − T(1)) / (N − 1)``, the minimum over interleaved rounds of synchronised
wall time, which removes prefill and per-call setup. ``ratio`` = captured ÷ uncaptured (below 1: replay saves launch overhead). Each record also
says whether both modes produced the same greedy tokens and how many replays the captured engine
counted against its decode steps (cumulative over the batches run so far).

The model is Qwen3-shaped with random weights (``decode_step.py``'s quick shape: 4 layers, hidden
512, ≈25M parameters, where launch overhead is most of a step); ``--quick`` runs fewer tokens and
rounds. Needs a CUDA device (run by ``benchmarks/device_check.sh``); ``--device cpu`` is a smoke
run of the script itself (nothing is captured on the CPU: both modes are the same code).

    python3 benchmarks/device_graphs.py [--quick] [--backend inductor|aot_eager] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import torch  # noqa: E402
from decode_step import QUICK, build_model  # noqa: E402

import dcpgraph  # noqa: E402
from dcpgraph.testing.device_graphs import replays_and_decode_steps  # noqa: E402

NAME = "device_graphs"
PROMPT = 8
MODES = ("FULL_DECODE_ONLY", "NONE")


def wall() -> float:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def engines_for(program, batches: list[int], new: int, backend: str) -> dict:
    """One engine per mode, buckets up to the largest batch (compiled and captured at start-up)."""
    most = max(batches)
    return {mode: dcpgraph.compile(program, backend=backend, cudagraph_mode=mode, max_num_seqs=most,
                                   max_num_batched_tokens=PROMPT * most, max_model_len=PROMPT + new + 8,
                                   kv_cache_tokens=(PROMPT + new + 16) * most, capture_limit=most)
            for mode in MODES}


def measure(engines: dict, vocab: int, batch: int, new: int, rounds: int, backend: str, device: str) -> list[dict]:
    prompts = torch.randint(0, vocab, (batch, PROMPT), generator=torch.Generator().manual_seed(batch)).tolist()
    tokens = {}

    def run(mode, n):
        tokens[mode] = engines[mode].generate(prompts, max_new_tokens=n)

    fns = {(mode, n): (lambda mode=mode, n=n: run(mode, n)) for mode in MODES for n in (new, 1)}
    for fn in fns.values():
        fn()  # warm-up
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for key, fn in fns.items():
            start = wall()
            fn()
            best[key] = min(best[key], wall() - start)
    run(MODES[0], new)
    run(MODES[1], new)
    step = {mode: (best[(mode, new)] - best[(mode, 1)]) / (new - 1) for mode in MODES}
    replays, decode_steps = replays_and_decode_steps(engines[MODES[0]].report())  # so far, every batch
    same = tokens[MODES[0]] == tokens[MODES[1]]
    config = (f"qwen3-25M fp32 {device} tp=1 {backend} batch={batch} prompt={PROMPT} new={new} min-of-{rounds} "
              f"clock=wall same-tokens={same} replays={sum(replays.values())} "
              f"decode-steps={sum(decode_steps.values())}")
    print(f"batch {batch}: captured {step[MODES[0]] * 1e3:.2f} ms/step, uncaptured {step[MODES[1]] * 1e3:.2f} "
          f"ms/step; tokens equal: {same}; replays {replays} vs decode steps {decode_steps}", flush=True)
    rec = common.record(NAME, config, "decode_step_ms", step[MODES[0]] * 1e3, "ms", baseline=step[MODES[1]] * 1e3)
    return [rec]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer new tokens and rounds")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the script")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA device (torch.cuda.is_available() is False)")
    new, rounds = (8, 2) if args.quick else (32, 3)
    start = time.perf_counter()
    model = build_model(QUICK, torch.float32).to(args.device)
    engines = engines_for(dcpgraph.trace(model), args.batches, new, args.backend)
    print(f"{args.backend}: both engines compiled (captured) in {time.perf_counter() - start:.0f} s", flush=True)
    records = []
    for batch in args.batches:
        records += measure(engines, QUICK["vocab_size"], batch, new, rounds, args.backend, args.device)
    return common.finish(NAME, records, start)


if __name__ == "__main__":
    sys.exit(main())
