"""Where a worker group's ranks run: one machine, or ``nnodes`` machines (vLLM's flags).

The ``tp`` ranks split evenly over the nodes, node ``n`` holding ranks ``[n·k, (n+1)·k)`` with
``k = tp / nnodes``. The head (node 0) runs the front end (the server or the ``LLM``) and its own
share, rank 0 among them (the deployment's engine); every other node runs ``--headless``: its share
of ranks and nothing else (:func:`run_headless`).

Data-parallel replicas (``data_parallel_size = D`` with ``nnodes = N``, ``N`` dividing ``D``) are
not split: node ``n`` runs replicas ``[n·D/N, (n+1)·D/N)`` whole (:class:`ReplicaPlacement`), so a
replica's TP, DCP and PCP collectives stay on one machine and only the front end's connections and
the EP group (with ``enable_expert_parallel``) cross nodes. A replica's ranks meet at a fresh port
on their own node; they connect to the head at ``master_addr:master_port + 1 + d`` (replica ``d``),
and the EP group's store is at ``master_addr:master_port``.

Addresses. On one node every port is a fresh one on ``worker_host``. Across nodes the ranks meet at
``master_addr:master_port`` (``torch.distributed``'s TCP rendezvous, hosted by rank 0 on the head),
and connect to the front end at ``master_addr:master_port + 1``. The connections are authenticated
with a key: a fresh random one on one node; across nodes every node must hold the same,
``$DCPGRAPH_WORKER_KEY`` (without it a fixed public key is used and a warning says so: set it on
any network other machines share).
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass

from ..runtime.ports import free_port

log = logging.getLogger("dcpgraph.serving")
KEY_ENV = "DCPGRAPH_WORKER_KEY"
PUBLIC_KEY = b"dcpgraph-workers"


@dataclass(frozen=True)
class NodeLayout:
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501

    @classmethod
    def of(cls, parallel) -> NodeLayout:
        """From the configuration's parallel section (``nnodes``, ``node_rank``, ``master_*``)."""
        return cls(parallel.nnodes, parallel.node_rank, parallel.master_addr, parallel.master_port)

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    def local_ranks(self, world: int) -> range:
        per_node = world // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    def world_address(self, host: str) -> tuple[str, int]:
        """Where the ranks' ``torch.distributed`` rendezvous is."""
        return (self.master_addr, self.master_port) if self.multi_node else (host, free_port(host))

    def front_end_address(self, host: str) -> tuple[str, int]:
        """Where the front end listens for the ranks' connections (port 0: any free one)."""
        return (self.master_addr, self.master_port + 1) if self.multi_node else (host, 0)

    def replica_placements(self, replicas: int) -> list[ReplicaPlacement]:
        """Where each of ``replicas`` data-parallel replicas runs (whole, ``replicas / nnodes`` a node)."""
        return [ReplicaPlacement(self, d, replicas) for d in range(replicas)]

    def expert_group_address(self, host: str) -> tuple[str, int]:
        """The EP group's store (hosted by replica 0's rank 0): ``master_addr:master_port`` across
        nodes, a fresh port on ``host`` on one."""
        return (self.master_addr, self.master_port) if self.multi_node else (host, free_port(host))

    def authkey(self) -> bytes:
        if not self.multi_node:
            return secrets.token_bytes(32)
        key = os.environ.get(KEY_ENV)
        if key:
            return key.encode()
        log.warning("$%s is not set: the worker connections use a fixed public key; set the same secret on "
                    "every node when other machines share the network", KEY_ENV)
        return PUBLIC_KEY


@dataclass(frozen=True)
class ReplicaPlacement:
    """Data-parallel replica ``replica`` of ``replicas`` seen from ``layout``'s node: it runs whole on
    node ``replica // (replicas / nnodes)``. The same interface as :class:`NodeLayout` for one
    worker group (:class:`~.workers.RemoteEngine` and the headless node take either)."""

    layout: NodeLayout
    replica: int
    replicas: int

    @property
    def node(self) -> int:
        return self.replica // (self.replicas // self.layout.nnodes)

    @property
    def multi_node(self) -> bool:
        return self.layout.multi_node

    @property
    def here(self) -> bool:
        """Whether this node runs the replica's ranks."""
        return self.node == self.layout.node_rank

    def local_ranks(self, world: int) -> range:
        return range(world) if self.here else range(0)

    def world_address(self, host: str) -> tuple[str, int]:
        """The replica's rendezvous: a fresh port on its own node (its ranks never leave it)."""
        host = host or "127.0.0.1"
        return (host, free_port(host))

    def front_end_address(self, host: str) -> tuple[str, int]:
        if not self.multi_node:
            return (host, 0)
        return (self.layout.master_addr, self.layout.master_port + 1 + self.replica)

    def authkey(self) -> bytes:
        return self.layout.authkey()
