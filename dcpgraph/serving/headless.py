"""A node other than the head (``dcpgraph serve --headless``): its share of the ranks, nothing else."""

from __future__ import annotations

import logging
import signal
import time

from .expert_replicas import replica_configs
from .nodes import NodeLayout
from .workers import start_workers

log = logging.getLogger("dcpgraph.serving")


def run_headless(config, layout: NodeLayout, *, timeout_s: float, start_method: str | None = None,
                 replicas: int = 1, expert_parallel: bool = False) -> int:
    """A node other than the head: start its share of ranks, and wait for them. Returns 0 when they
    all stop cleanly (the head shut the group down), 1 as soon as one fails (the others are then
    stopped). SIGTERM or SIGINT stops them too. With ``replicas > 1`` (data parallelism) its share
    is the whole replicas :meth:`NodeLayout.replica_placements` puts here; with ``expert_parallel``
    they join the EP group at the head as the head's own replicas do."""
    if replicas > 1:
        procs = _start_replicas(config, layout, replicas, expert_parallel, timeout_s, start_method)
    else:
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


def _start_replicas(config, layout: NodeLayout, replicas: int, expert_parallel: bool, timeout_s: float,
                    start_method: str | None) -> list:
    """This node's whole data-parallel replicas, each a worker group of its own (with the EP
    group's record when the replicas share the routed experts)."""
    configs = replica_configs(config, replicas, *layout.expert_group_address("")) if expert_parallel \
        else [config] * replicas
    procs, here = [], [p for p in layout.replica_placements(replicas) if p.here]
    authkey = layout.authkey()
    for placement in here:
        replica_config = configs[placement.replica]
        procs += start_workers(replica_config, placement.local_ranks(replica_config.world_size),
                               world_address=placement.world_address(""), front_end=placement.front_end_address(""),
                               authkey=authkey, timeout_s=timeout_s, start_method=start_method)
    log.info("node %d of %d: data-parallel replicas %s, worker pids %s", layout.node_rank, layout.nnodes,
             [p.replica for p in here], [p.pid for p in procs])
    return procs
