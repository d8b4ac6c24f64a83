"""``TorchDistributedConnector``: KV transfer over ``torch.distributed`` point-to-point (gloo here;
the same calls run on HCCL/NCCL process groups where those devices exist).

Rendezvous is its own: a ``TCPStore`` on ``kv_ip:kv_port``, hosted by the instance with
``kv_rank == 0`` (:meth:`TorchDistributedConnector.host_store`), never an instance's TP world.
Signalling keys live under ``kv/<transfer id>/``. Each transfer builds a fresh gloo group of
``producer tp·pcp + consumer tp·pcp`` ranks on a ``PrefixStore`` of that id and drops it afterwards, so a
peer that died fails only the transfer it was in: the next transfer rendezvouses anew. Every wait
(the store, the group's connect, each send and receive, the closing barrier) is bounded by
``timeout_s``.
"""

from __future__ import annotations

import datetime
import json

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

from ...errors import KVTransferError
from .base import KVConnector


class TorchDistributedConnector(KVConnector):
    def __init__(self, host: str = "127.0.0.1", port: int = 14579, *, timeout_s: float = 30.0):
        self.host, self.port, self.timeout_s = host, int(port), float(timeout_s)
        self._master: dist.TCPStore | None = None
        self._store: dist.TCPStore | None = None

    @property
    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def host_store(self) -> None:
        """Serve the rendezvous store on ``host:port`` from this process (the ``kv_rank == 0`` instance)."""
        try:
            self._master = dist.TCPStore(self.host, self.port, is_master=True, wait_for_workers=False,
                                         timeout=self._timeout)
        except Exception as err:
            raise KVTransferError(f"cannot host the KV transfer store on {self.host}:{self.port}: {err}") from None

    def close(self) -> None:
        self._store = self._master = None

    def _client(self) -> dist.TCPStore:
        if self._store is None:
            try:
                self._store = dist.TCPStore(self.host, self.port, is_master=False, timeout=self._timeout)
            except Exception as err:
                raise KVTransferError(f"cannot reach the KV transfer store at {self.host}:{self.port} "
                                      f"(kv_ip:kv_port of the kv_rank 0 instance): {err}") from None
        return self._store

    def _store_call(self, fn):
        try:
            return fn(self._client())
        except KVTransferError:
            raise
        except Exception as err:  # the store's host went away: reconnect next time
            self._store = None
            raise KVTransferError(f"KV transfer store at {self.host}:{self.port} failed: {err}") from None

    # -- signalling ----------------------------------------------------------------------------------
    def request_kv(self, transfer_id: str, metadata: dict) -> None:
        self._store_call(lambda s: s.set(f"kv/{transfer_id}/ask", json.dumps(metadata)))

    def poll_requests(self, transfer_ids: list[str]) -> dict[str, dict]:
        def poll(store):
            return {t: json.loads(store.get(f"kv/{t}/ask")) for t in transfer_ids if store.check([f"kv/{t}/ask"])}
        return self._store_call(poll) if transfer_ids else {}

    def fail(self, transfer_id: str, reason: str) -> None:
        self._store_call(lambda s: s.set(f"kv/{transfer_id}/failed", reason))

    def failure(self, transfer_id: str) -> str | None:
        key = f"kv/{transfer_id}/failed"
        return self._store_call(lambda s: s.get(key).decode() if s.check([key]) else None)

    # -- data ------------------------------------------------------------------------------------------
    def join_group(self, transfer_id: str, rank: int, size: int) -> ProcessGroupGloo:
        """The gloo group of ``transfer_id`` (returns once all ``size`` members joined)."""
        store = dist.TCPStore(self.host, self.port, is_master=False, timeout=self._timeout)
        options = ProcessGroupGloo._Options()
        loopback = self.host.startswith("127.") or self.host == "localhost"
        options._devices = [ProcessGroupGloo.create_device(hostname=self.host) if loopback
                            else ProcessGroupGloo.create_default_device()]
        options._timeout = self._timeout
        return ProcessGroupGloo(dist.PrefixStore(f"kv/{transfer_id}/group/", store), rank, size, options)

    def exchange(self, transfer_id: str, rank: int, size: int, sends: dict[int, torch.Tensor],
                 recv_bytes: dict[int, int]) -> dict[int, torch.Tensor]:
        stage = "joining the transfer group"
        try:
            group = self.join_group(transfer_id, rank, size)
            stage = "moving KV"
            received = {src: torch.empty(n, dtype=torch.uint8) for src, n in recv_bytes.items()}
            works = [group.send([buf.contiguous()], dst, 0) for dst, buf in sends.items()]
            works += [group.recv([buf], src, 0) for src, buf in received.items()]
            for work in works:
                work.wait(self._timeout)
            # A sender's send completes once its bytes are in the socket; closing the group then
            # can reset the connection before a slower receiver read them. Nobody leaves until
            # every member has everything.
            stage = "waiting for every rank to finish"
            group.barrier().wait(self._timeout)
        except Exception as err:
            raise KVTransferError(f"KV transfer {transfer_id}: rank {rank} of {size} failed while {stage} "
                                  f"(timeout {self.timeout_s:g} s): {type(err).__name__}: {err}") from None
        return received
