"""``KVAgent``: the driver side of P/D in one engine (a serving instance, or one data-parallel
replica of it, :mod:`.replicas`), called only from the instance's engine thread.

Producer (``kv_producer``/``kv_both``): a request sent with ``kv_transfer_params:
{"do_remote_decode": true}`` runs to its first token; then :meth:`KVAgent.hold` keeps its blocks
under a fresh transfer id and answers the parameters a consumer needs (``kv_replica`` names the
replica whose endpoint holds it). :meth:`KVAgent.tick` (every engine-loop turn) serves the
consumers' asks: every rank gathers and sends, then the blocks are freed, whether the send
succeeded or not. A held request nobody asked for within ``hold_timeout_s`` is freed and marked
failed.

Consumer (``kv_consumer``/``kv_both``): :meth:`KVAgent.receive` adopts the request (its own prefix
cache may already hold the first blocks: those are not received), asks the producer, and every rank
receives its rows, all on the rendezvous of the replica the parameters name. Any failure (the
producer died, never joined, the transfer timed out) aborts the request, so its blocks are free,
and raises :class:`~dcpgraph.errors.KVTransferError`.

Nothing waits longer than ``transfer_timeout_s`` per transfer; the engine thread is busy for the
length of each transfer it serves (the decode side therefore pauses its other requests meanwhile).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from ...errors import ConfigError, KVTransferError, RequestError
from . import rank_ops
from .config import KVTransferConfig
from .plan import KVSide, check_compatible

log = logging.getLogger("dcpgraph.serving")
PARAM_KEYS = ("transfer_id", "producer", "prompt_token_ids", "output_token_ids", "computed")
# The integer entries of ``KVAgent.stats``: counters since start, and ``held`` (transfers held now).
# Every one is a sum over an instance's data-parallel replicas (:class:`~.replicas.ReplicaKVAgents`).
COUNTERS = ("transfers_sent", "transfers_received", "bytes_sent", "bytes_received", "tokens_sent", "tokens_received",
            "tokens_from_prefix_cache", "failures", "expired", "held")


@dataclass
class _Held:
    rid: int
    computed: int
    deadline: float


class KVAgent:
    """The agent of one engine: the instance's, or data-parallel replica ``replica``'s (whose
    endpoint is ``kv_port + replica``, :meth:`KVTransferConfig.for_replica`)."""

    def __init__(self, config: KVTransferConfig, engine, *, replica: int = 0):
        self.base = config  # the instance's configuration: other replicas' endpoints derive from it
        self.config = config.for_replica(replica)
        self.replica = replica
        self.engine = engine
        self.connector = self.config.connector()
        self._connectors = {self.config.kv_port: self.connector}  # per endpoint this consumer pulled from
        if config.hosts_store:
            self.connector.host_store()
        self.side = self._call("side", {})[0]
        self.held: dict[str, _Held] = {}
        self.stats = {"role": config.kv_role, "kv_rank": config.kv_rank, "kv_replica": replica,
                      "kv_port": self.config.kv_port, **dict.fromkeys(COUNTERS, 0),
                      "last_transfer_s": None, "last_error": None}

    def _call(self, fn: str, args: dict) -> list:
        """``rank_ops.<fn>`` on every rank of this instance; one value per rank."""
        return self.engine.rank_call(rank_ops.op_name(fn), args)

    def _failed(self, message: str) -> KVTransferError:
        self.stats["failures"] += 1
        self.stats["last_error"] = message
        log.error("%s", message)
        return KVTransferError(message)

    # -- producer -----------------------------------------------------------------------------------
    def hold(self, rid: int) -> dict:
        info = self._call("hold", {"rid": rid})[0]
        transfer_id = f"{self.config.kv_rank}.{self.replica}-{uuid.uuid4().hex}"
        self.held[transfer_id] = _Held(rid, info["computed"], time.monotonic() + self.config.hold_timeout_s)
        self.stats["held"] = len(self.held)
        prompt_len = info["prompt_len"]
        return {"transfer_id": transfer_id, "producer": self.side, "kv_rank": self.config.kv_rank,
                "kv_replica": self.replica,
                "prompt_token_ids": info["tokens"][:prompt_len], "output_token_ids": info["tokens"][prompt_len:],
                "computed": info["computed"]}

    def _release(self, transfer_id: str) -> None:
        held = self.held.pop(transfer_id)
        self._call("release", {"rid": held.rid})
        self.stats["held"] = len(self.held)

    def tick(self) -> None:
        if not self.held:
            return
        now = time.monotonic()
        for transfer_id in [t for t, h in self.held.items() if h.deadline < now]:
            self._release(transfer_id)
            self.stats["expired"] += 1
            reason = f"the producer freed transfer {transfer_id}: no consumer asked within {self.config.hold_timeout_s:g} s"
            log.warning("%s", reason)
            try:
                self.connector.fail(transfer_id, reason)
            except KVTransferError as err:
                log.warning("%s", err)
        try:
            asks = self.connector.poll_requests(list(self.held))
        except KVTransferError as err:
            log.warning("%s", err)
            return
        for transfer_id, ask in asks.items():
            self._serve(transfer_id, ask)

    def _serve(self, transfer_id: str, ask: dict) -> None:
        held = self.held[transfer_id]
        start, end = int(ask["start"]), min(int(ask["end"]), held.computed)
        began = time.monotonic()
        try:
            sent = sum(self._call("send", {"rid": held.rid, "transfer_id": transfer_id, "consumer": ask["consumer"],
                                           "start": start, "end": end, "config": self.config.to_json()}))
        except Exception as err:  # the consumer died or timed out: this side just frees the blocks
            self._failed(f"KV transfer {transfer_id} to the consumer failed: {err}")
            try:
                self.connector.fail(transfer_id, str(err))
            except KVTransferError:
                pass
            return
        finally:
            self._release(transfer_id)
        self.stats["transfers_sent"] += 1
        self.stats["bytes_sent"] += sent
        self.stats["tokens_sent"] += end - start
        self.stats["last_transfer_s"] = time.monotonic() - began
        log.info("KV transfer %s: sent tokens [%d, %d), %d bytes in %.3f s", transfer_id, start, end, sent,
                 self.stats["last_transfer_s"])

    # -- consumer ---------------------------------------------------------------------------------------
    def receive(self, prompt_ids: list[int], max_tokens: int, sampling: dict, params: dict) -> tuple[int, list[int]]:
        """Adopt and fill a transferred request; returns ``(engine request id, tokens the producer
        sampled)``. Raises ``RequestError`` for bad parameters, ``KVTransferError`` if the transfer fails."""
        missing = [k for k in PARAM_KEYS if k not in params]
        if missing:
            raise RequestError(f"kv_transfer_params lack {missing}: pass on what the producer's response returned")
        if [int(t) for t in params["prompt_token_ids"]] != list(prompt_ids):
            raise RequestError("kv_transfer_params belong to another prompt (prompt_token_ids differ)")
        transfer_id, computed = str(params["transfer_id"]), int(params["computed"])
        if computed != len(prompt_ids):
            raise RequestError(f"kv_transfer_params: computed={computed}, expected the prompt length {len(prompt_ids)}")
        output = [int(t) for t in params["output_token_ids"]]
        try:
            endpoint = self.base.endpoint_of(params)
        except ConfigError as err:
            raise RequestError(str(err)) from None
        connector = self._connector_at(endpoint)
        failure = connector.failure(transfer_id)
        if failure is not None:
            raise self._failed(f"KV transfer {transfer_id} cannot happen: {failure}")
        try:  # refused here, before this side adopts anything or any rank joins a transfer group
            check_compatible(KVSide.from_json(params["producer"]), KVSide.from_json(self.side))
        except (ValueError, KeyError, TypeError) as err:
            raise RequestError(f"KV transfer {transfer_id} refused: {err}") from None
        adopted = self._call("adopt", {"prompt": list(prompt_ids), "output": output, "max_new_tokens": max_tokens,
                                       "sampling": sampling})[0]
        rid, start = adopted["rid"], adopted["start"]
        began = time.monotonic()
        try:
            connector.request_kv(transfer_id, {"consumer": self.side, "start": start, "end": computed})
            received = sum(self._call("recv", {"rid": rid, "transfer_id": transfer_id, "producer": params["producer"],
                                               "start": start, "end": computed, "config": endpoint.to_json()}))
        except Exception as err:
            self.engine.abort(rid)
            raise self._failed(f"KV transfer {transfer_id} from the producer failed; the request was "
                               f"dropped and its blocks freed: {err}") from None
        self.stats["transfers_received"] += 1
        self.stats["bytes_received"] += received
        self.stats["tokens_received"] += computed - start
        self.stats["tokens_from_prefix_cache"] += start
        self.stats["last_transfer_s"] = time.monotonic() - began
        log.info("KV transfer %s: received tokens [%d, %d) (%d from this prefix cache), %d bytes in %.3f s",
                 transfer_id, start, computed, start, received, self.stats["last_transfer_s"])
        return rid, output

    def _connector_at(self, endpoint: KVTransferConfig):
        """The signalling connector of ``endpoint`` (a producer replica's rendezvous), made once."""
        if endpoint.kv_port not in self._connectors:
            self._connectors[endpoint.kv_port] = endpoint.connector()
        return self._connectors[endpoint.kv_port]

    def close(self) -> None:
        for transfer_id in list(self.held):
            try:
                self._release(transfer_id)
            except Exception:
                break
        for connector in self._connectors.values():
            connector.close()
