"""A node other than the head (``dcpgraph serve --headless``): its share of the ranks, nothing else."""

from __future__ import annotations

import logging
import signal
import time

from .nodes import NodeLayout
from .workers import start_workers

log = logging.getLogger("dcpgraph.serving")


def run_headless(config, layout: NodeLayout, *, timeout_s: float, start_method: str | None = None) -> int:
    """A node other than the head: start its share of ranks, and wait for them. Returns 0 when they
    all stop cleanly (the head shut the group down), 1 as soon as one fails (the others are then
    stopped). SIGTERM or SIGINT stops them too."""
    world = config.world_size
    ranks = layout.local_ranks(world)
    address = layout.world_address("")
    procs = start_workers(config, ranks, world_address=address, front_end=layout.front_end_address(""),
                          authkey=layout.authkey(), timeout_s=timeout_s, start_method=start_method)
    log.info("node %d of %d: ranks %s, worker pids %s; rendezvous at %s:%d", layout.node_rank, layout.nnodes,
             list(ranks), [p.pid for p in procs], *address)
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    try:
        while not stopping:
            codes = [p.exitcode for p in procs]
            if any(c not in (None, 0) for c in codes):
                log.error("a worker failed (exit codes %s): stopping this node's ranks", codes)
                return 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.25)
        return 0
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
