"""``--kv-transfer-config``: vLLM's key names, validated before anything starts.

::

    {"kv_role": "kv_producer", "kv_rank": 0, "kv_parallel_size": 2, "kv_port": 14579}   # prefill
    {"kv_role": "kv_consumer", "kv_rank": 1, "kv_parallel_size": 2, "kv_port": 14579}   # decode

``kv_role``: ``kv_producer`` (runs prefill, hands KV over), ``kv_consumer`` (continues decoding
from received KV) or ``kv_both``. ``kv_connector``: the transport; the default
(``TorchDistributedConnector``) needs no naming. ``kv_rank`` in ``[0, kv_parallel_size)``: the
instance with ``kv_rank == 0`` hosts the rendezvous store on ``kv_ip:kv_port`` (``kv_ip`` default
127.0.0.1). ``kv_connector_extra_config``: ``transfer_timeout_s`` (bound on one transfer's
rendezvous and data, default 30) and ``hold_timeout_s`` (how long a producer keeps a prefilled
request's blocks for a consumer that has not asked yet, default 60).

With data parallelism (``-dp D``) every replica ``r`` of an instance has its own KV agent and
rendezvous endpoint, ``kv_ip:kv_port + r`` (:meth:`KVTransferConfig.for_replica`); the ``kv_rank
0`` instance hosts one store per replica. A producer's replica ``r`` holds its transfers there
and names ``r`` in the parameters it returns (``kv_replica``); a consumer pulls from that
replica's endpoint (:meth:`KVTransferConfig.endpoint_of`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from ...errors import ConfigError

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("TorchDistributedConnector",)
KEYS = ("kv_role", "kv_connector", "kv_rank", "kv_parallel_size", "kv_ip", "kv_port", "kv_connector_extra_config")
EXTRA_KEYS = ("transfer_timeout_s", "hold_timeout_s")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_role: str
    kv_rank: int = 0
    kv_parallel_size: int = 2
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector: str = "TorchDistributedConnector"
    transfer_timeout_s: float = 30.0
    hold_timeout_s: float = 60.0

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def hosts_store(self) -> bool:
        return self.kv_rank == 0

    def replica_port(self, replica: int) -> int:
        """The rendezvous port of data-parallel replica ``replica``: ``kv_port + replica``."""
        port = self.kv_port + replica
        if replica < 0 or port > 65535:
            raise ConfigError(f"--kv-transfer-config: replica {replica} has no rendezvous port (kv_port {self.kv_port} "
                              f"+ replica must be in [kv_port, 65535])")
        return port

    def for_replica(self, replica: int) -> KVTransferConfig:
        """This configuration as replica ``replica``'s KV agent uses it (its own rendezvous port)."""
        return replace(self, kv_port=self.replica_port(replica))

    def endpoint_of(self, params: dict) -> KVTransferConfig:
        """Where the KV of a producer's returned ``params`` is pulled from: the endpoint of the
        replica they name (``kv_replica``, 0 when absent: a producer without data parallelism)."""
        replica = params.get("kv_replica", 0)
        if isinstance(replica, bool) or not isinstance(replica, int):
            raise ConfigError(f"kv_transfer_params: kv_replica must be a replica index (int >= 0), got {replica!r}")
        return self.for_replica(replica)

    def connector(self):
        from .torch_distributed import TorchDistributedConnector

        return TorchDistributedConnector(self.kv_ip, self.kv_port, timeout_s=self.transfer_timeout_s)

    def to_json(self) -> dict:
        return {"kv_role": self.kv_role, "kv_rank": self.kv_rank, "kv_parallel_size": self.kv_parallel_size,
                "kv_ip": self.kv_ip, "kv_port": self.kv_port, "kv_connector": self.kv_connector,
                "kv_connector_extra_config": {"transfer_timeout_s": self.transfer_timeout_s,
                                              "hold_timeout_s": self.hold_timeout_s}}


def _int(data: dict, key: str, default: int, low: int, high: int | None = None) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ConfigError(f"--kv-transfer-config: {key} must be an int in {bound}, got {value!r}")
    return value


def parse_kv_transfer_config(text: str | dict) -> KVTransferConfig:
    """Parse and check a ``--kv-transfer-config`` value; ``ConfigError`` names the bad key and
    the valid values."""
    if isinstance(text, str):
        try:
            data = json.loads(text)
        except ValueError as err:
            raise ConfigError(f"--kv-transfer-config is not valid JSON: {err}") from None
    else:
        data = dict(text)
    if not isinstance(data, dict):
        raise ConfigError("--kv-transfer-config must be a JSON object")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ConfigError(f"--kv-transfer-config: unknown key(s) {unknown}; valid keys: {list(KEYS)}")
    role = data.get("kv_role")
    if role not in ROLES:
        raise ConfigError(f"--kv-transfer-config: kv_role must be one of {list(ROLES)}, got {role!r}")
    connector = data.get("kv_connector") or CONNECTORS[0]
    if connector not in CONNECTORS:
        raise ConfigError(f"--kv-transfer-config: kv_connector must be one of {list(CONNECTORS)} "
                          f"(or left out), got {connector!r}")
    size = _int(data, "kv_parallel_size", 2, 1)
    rank = _int(data, "kv_rank", 0, 0, size - 1)
    port = _int(data, "kv_port", 14579, 1, 65535)
    ip = data.get("kv_ip", "127.0.0.1")
    if not isinstance(ip, str) or not ip:
        raise ConfigError(f"--kv-transfer-config: kv_ip must be a host name or address, got {ip!r}")
    extra = data.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict) or set(extra) - set(EXTRA_KEYS):
        raise ConfigError(f"--kv-transfer-config: kv_connector_extra_config takes {list(EXTRA_KEYS)}, got {extra!r}")
    timeouts = {}
    for key, default in (("transfer_timeout_s", 30.0), ("hold_timeout_s", 60.0)):
        value = extra.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"--kv-transfer-config: kv_connector_extra_config.{key} must be a number > 0, "
                              f"got {value!r}")
        timeouts[key] = float(value)
    return KVTransferConfig(role, rank, size, ip, port, connector, **timeouts)
