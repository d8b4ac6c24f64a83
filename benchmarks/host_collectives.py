"""Shared-memory collectives against gloo, with ranks up to twice the cores (oversubscribed).

Each rank of a ``spawn``-ed world (one thread each) runs ``--iters`` iterations of ``--work``
256 × 256 fp32 matmuls (~0.45 ms each on the AMD VM: a layer's worth of compute) followed by an
all-reduce of ``--kib`` KiB through the world's tp group, as a decode step's layers do. Per world
size and transport (``DCPGRAPH_HOST_COLLECTIVES`` = ``shm``, the default, or ``gloo``, set for the
whole world, in each rank) it reports each rank's wall time and process CPU time per iteration (rank 0's and
the slowest rank's) and the shm/gloo ratios. With more ranks than cores a waiting rank's spinning
competes with the ranks still computing; this measures whether that costs more than gloo's
worker threads do.

    python3 benchmarks/host_collectives.py [--worlds 2 4] [--work 1] [--iters 100] [--kib 4]

Writes ``benchmarks/results/host_collectives.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the checkout on sys.path)

NAME = "host_collectives"
TRANSPORTS = ("shm", "gloo")


def worker(rank: int, world: int, transport: str, work: int, iters: int, kib: int) -> tuple[float, float, str]:
    # set here: the ranks come from a fork server started once, which keeps the environment it began with
    os.environ["DCPGRAPH_HOST_COLLECTIVES"] = transport
    import torch
    import torch.distributed as dist

    from dcpgraph.mesh import Mesh
    from dcpgraph.runtime.distributed import register_mesh_groups, transports

    torch.set_num_threads(1)
    register_mesh_groups(Mesh(tp=world, dcp=1))
    x = torch.ones(kib * 256)
    w = torch.randn(256, 256)
    reduce = torch.ops._c10d_functional

    def all_reduce():
        reduce.wait_tensor(reduce.all_reduce(x, "sum", "dcpgraph.tp"))

    for _ in range(20):
        all_reduce()
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(iters):
        for _ in range(work):
            w @ w
        all_reduce()
    wall, cpu = (time.perf_counter() - t0) / iters, (time.process_time() - c0) / iters
    return wall, cpu, str(transports().get("tp", "?"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--work", type=int, default=1, help="256x256 matmuls between two all-reduces")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--kib", type=int, default=4, help="all-reduce payload per rank")
    args = parser.parse_args(argv)
    from dcpgraph.runtime.distributed import spawn

    start = time.perf_counter()
    records, seen = [], {}
    for world in args.worlds:
        for transport in TRANSPORTS:
            results = spawn(worker, world, transport, args.work, args.iters, args.kib)
            walls, cpus = [r[0] * 1e3 for r in results], [r[1] * 1e3 for r in results]
            config = (f"world={world} cores={os.cpu_count()} transport={transport} ({results[0][2]}) "
                      f"work={args.work} matmul iters={args.iters} payload={args.kib}KiB {common.load_note()}")
            base = seen.get((world, "shm")) if transport == "gloo" else None
            rows = [("iteration_wall_rank0", walls[0]), ("iteration_wall_slowest", max(walls)),
                    ("iteration_cpu_rank0", cpus[0]), ("iteration_cpu_max", max(cpus))]
            for metric, value in rows:
                extra = {} if base is None else {"baseline": base[metric], "ratio": round(base[metric] / value, 4)}
                records.append(common.record(NAME, config, metric, value, "ms", digits=4, **extra))
            seen[(world, transport)] = dict(rows)
            print(f"world {world} {transport:4s}: wall {walls[0]:.2f} ms an iteration (slowest rank {max(walls):.2f}), "
                  f"cpu {cpus[0]:.2f} ms (most {max(cpus):.2f})"
                  + ("" if base is None else f"; shm/gloo wall {base['iteration_wall_slowest'] / max(walls):.2f}, "
                     f"cpu {base['iteration_cpu_max'] / max(cpus):.2f}"), flush=True)
    out = common.write(NAME, records)
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
