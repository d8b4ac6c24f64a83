"""Per-step cost of driving worker processes: the driver's step time minus the ranks' own.

    python3 benchmarks/driver_overhead.py [--quick]

A tiny Qwen3 checkpoint is served by ``LLM`` at tp = 2 and 4 (one worker process per rank, gloo,
dcp = 2) with 8 running requests; every decode step the driver times ``RemoteEngine.step()`` and
the ranks report the time their own ``Engine.step()`` took. The difference is what the driver/worker
link costs a step: the call framed and sent to every rank, the ranks' replies (events and
logprobs) received and checked equal. With every rank running the whole engine in lockstep
(today's design) this is a round trip per step; the figure is the baseline for a driver that
schedules once and ships packed step inputs instead.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from common import load_note, record, write

from dcpgraph import LLM
from dcpgraph.testing.checkpoints import save_tiny_checkpoint


def measure(path: str, tp: int, steps: int) -> dict:
    with LLM(model=path, dtype="float32", block_size=4, tensor_parallel_size=tp, decode_context_parallel_size=2,
             max_num_seqs=8) as llm:
        engine = llm.engine
        for i in range(8):
            engine.add_request([5 + i, 9, 4, 77], steps + 4)
        driver, ranks = [], []
        engine.step()  # the prefill
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            driver.append(time.perf_counter() - start)
            ranks.append(max(engine.last_step_rank_seconds))
    overhead = [d - r for d, r in zip(driver, ranks)]
    return {"driver_ms": statistics.median(driver) * 1e3, "rank_ms": statistics.median(ranks) * 1e3,
            "overhead_us": statistics.median(overhead) * 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20 decode steps instead of 60")
    args = parser.parse_args(argv)
    steps = 20 if args.quick else 60
    records = []
    with tempfile.TemporaryDirectory() as root:
        path = save_tiny_checkpoint(f"{root}/qwen3", "qwen3")
        for tp in (2, 4):
            m = measure(path, tp, steps)
            config = f"qwen3 tiny, tp={tp} dcp=2, batch 8 decode, {steps} steps, {load_note()}"
            print(f"tp={tp}: driver step {m['driver_ms']:.2f} ms, rank step {m['rank_ms']:.2f} ms, "
                  f"driver/worker overhead {m['overhead_us']:.0f} us a step")
            records += [record("driver_overhead", config, "driver_step_ms", m["driver_ms"], "ms"),
                        record("driver_overhead", config, "rank_step_ms", m["rank_ms"], "ms"),
                        record("driver_overhead", config, "overhead_per_step_us", m["overhead_us"], "us",
                               baseline=m["rank_ms"] * 1e3)]
    print(f"wrote {write('driver_overhead', records)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
