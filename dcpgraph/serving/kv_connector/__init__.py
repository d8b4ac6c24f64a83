"""Prefill/decode disaggregation across processes: a KV connector between two serving instances.

- :mod:`.config`: ``--kv-transfer-config`` (vLLM's keys), validated up front;
- :mod:`.base`: the :class:`KVConnector` interface (signalling between drivers, data between ranks);
- :mod:`.torch_distributed`: :class:`TorchDistributedConnector`, gloo point-to-point on its own
  ``TCPStore`` rendezvous;
- :mod:`.plan`: which producer rank sends which rows (or whole blocks) to which consumer rank,
  across dcp, tp (KV heads re-split), interleave and block size;
- :mod:`.rank_ops`: what a rank does next to its engine; :mod:`.agent`: what a driver does;
- :mod:`.replicas`: one agent per data-parallel replica (``-dp``), each at ``kv_port + r``.
"""

from .base import KVConnector, KVTransferError
from .config import KVTransferConfig, parse_kv_transfer_config
from .torch_distributed import TorchDistributedConnector

__all__ = ["KVConnector", "KVTransferConfig", "KVTransferError", "TorchDistributedConnector",
           "parse_kv_transfer_config"]
