"""``KVConnector``: what a transport between a prefill (producer) and a decode (consumer) instance
provides. Two planes:

- *signalling*, between the instances' drivers: the consumer asks for a transfer
  (:meth:`KVConnector.request_kv`, with the metadata the producer needs: the consumer's layout and
  the positions it wants); the producer finds the asks for the transfers it holds
  (:meth:`KVConnector.poll_requests`); either side can mark a transfer failed
  (:meth:`KVConnector.fail`) so the other stops waiting early (:meth:`KVConnector.failure`);
- *data*, between ranks: every rank of both instances joins one short-lived transfer group of
  ``producer tp·pcp + consumer tp·pcp`` members (producer ranks first) and moves one byte buffer per
  (producer rank, consumer rank) pair (:meth:`KVConnector.exchange`).

Every wait is bounded by ``timeout_s``; a failure or timeout raises
:class:`~dcpgraph.errors.KVTransferError` naming the transfer and what was awaited.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ...errors import KVTransferError

__all__ = ["KVConnector", "KVTransferError"]


class KVConnector(ABC):
    timeout_s: float

    # -- signalling (drivers) ----------------------------------------------------------------------
    @abstractmethod
    def request_kv(self, transfer_id: str, metadata: dict) -> None:
        """Consumer: ask the producer holding ``transfer_id`` to send (``metadata`` is JSON)."""

    @abstractmethod
    def poll_requests(self, transfer_ids: list[str]) -> dict[str, dict]:
        """Producer: the asks that arrived for any of ``transfer_ids`` (non-blocking)."""

    @abstractmethod
    def fail(self, transfer_id: str, reason: str) -> None:
        """Either side: record that ``transfer_id`` will not happen."""

    @abstractmethod
    def failure(self, transfer_id: str) -> str | None:
        """The recorded failure of ``transfer_id``, if any (non-blocking)."""

    # -- data (ranks) ---------------------------------------------------------------------------------
    @abstractmethod
    def exchange(self, transfer_id: str, rank: int, size: int, sends: dict[int, torch.Tensor],
                 recv_bytes: dict[int, int]) -> dict[int, torch.Tensor]:
        """Join ``transfer_id``'s group as ``rank`` of ``size``; send each ``sends[dst]`` (a uint8
        tensor) and receive ``recv_bytes[src]`` bytes from each ``src``; returns the received
        buffers once every send and receive completed. A rank with nothing to move still joins."""
