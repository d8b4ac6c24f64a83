"""Where a worker group's ranks run: one machine, or ``nnodes`` machines (vLLM's flags).

The ``tp`` ranks split evenly over the nodes, node ``n`` holding ranks ``[n·k, (n+1)·k)`` with
``k = tp / nnodes``. The head (node 0) runs the front end (the server or the ``LLM``) and its own
share, rank 0 among them (the deployment's engine); every other node runs ``--headless``: its share
of ranks and nothing else (:func:`run_headless`).

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

    def authkey(self) -> bytes:
        if not self.multi_node:
            return secrets.token_bytes(32)
        key = os.environ.get(KEY_ENV)
        if key:
            return key.encode()
        log.warning("$%s is not set: the worker connections use a fixed public key; set the same secret on "
                    "every node when other machines share the network", KEY_ENV)
        return PUBLIC_KEY
