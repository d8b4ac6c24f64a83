"""Few-row fp32 linears: ``dcpgraph.linear_f32``'s native kernel against torch's ``F.linear``.

A decode step's linear reads its whole weight for ``M`` = batch rows, so the floor is the weight's
bytes ÷ read bandwidth at every small ``M``. For each weight shape (a ~30M-parameter Qwen3's
projections and LM head, and a 4096×4096 layer) and M in 1, 2, 4, 8, 16, the two are timed
interleaved rep by rep on weights larger than the last-level cache in total (several copies, read
in turn, so each call streams its weight from memory), and the ratio native ÷ torch is printed
(below 1: the native kernel is faster). Target: ≤ 0.7 at every M from 2 to 8 on the largest shape.

    python benchmarks/linear_f32.py [--reps 30]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import copies_past_cache, finish, interleaved, median, record, with_target

from dcpgraph.ops import linear_f32 as native

NAME = "linear_f32"
SHAPES = [(2816, 512), (512, 1408), (16000, 512), (4096, 4096)]
ROWS = (1, 2, 4, 8, 16)


def calls(x: torch.Tensor, weights: list[torch.Tensor]) -> dict:
    """torch's and the native linear of ``x``, each call by the next weight copy in turn."""
    turn = iter(range(1 << 62))

    def weight() -> torch.Tensor:
        return weights[next(turn) % len(weights)]

    return {"torch": lambda: torch.nn.functional.linear(x, weight()),
            "native": lambda: native.linear_f32(x, weight())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    start = time.perf_counter()
    if not native.native_enabled():
        print(f"native fp32 linear unavailable: {native.reason()}")
        return 1
    records = []
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        weights = [torch.randn(n, k, generator=gen) for _ in range(copies_past_cache(n * k * 4))]
        for m in ROWS:
            times = interleaved(calls(torch.randn(m, k, generator=gen), weights), args.reps, warmup=2)
            t_torch, t_native = median(times["torch"]), median(times["native"])
            config = f"W {n}x{k} fp32, M={m}, {torch.get_num_threads()} threads"
            rec = record(NAME, config, "native_seconds", t_native, "s", baseline=t_torch)
            rec["native_GBps"] = round(n * k * 4 / t_native / 1e9, 2)
            rec["torch_GBps"] = round(n * k * 4 / t_torch / 1e9, 2)
            if (n, k) == SHAPES[-1] and 2 <= m <= 8:
                with_target(rec, "native ≤ 0.7× torch", rec["ratio"] <= 0.7, f"ratio {rec['ratio']}")
            records.append(rec)
            print(f"{config}: native {t_native * 1e6:.0f} us ({rec['native_GBps']} GB/s), torch "
                  f"{t_torch * 1e6:.0f} us ({rec['torch_GBps']} GB/s), ratio {rec['ratio']}", flush=True)
    return finish(NAME, records, start)


if __name__ == "__main__":
    raise SystemExit(main())
