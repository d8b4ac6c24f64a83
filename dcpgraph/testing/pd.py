"""Helpers for P/D tests and benchmarks: ``--kv-transfer-config`` values, KV usage and transfer
counters read from a running ``dcpgraph serve`` (bounded waits)."""

from __future__ import annotations

import contextlib
import json
import time

from ..runtime.ports import binds, free_port

SERVE_ARGS = ("--dtype", "float64", "--block-size", "4", "--max-model-len", "256", "--served-model-name", "tiny",
              "--enable-prefix-caching")


def consecutive_free_ports(count: int = 2, host: str = "127.0.0.1") -> int:
    """A port ``p`` such that ``p .. p + count - 1`` all bind now: the rendezvous ports
    (``kv_port + r``) of a ``-dp count`` P/D instance. ``AssertionError`` if 32 draws find none."""
    for _ in range(32):
        port = free_port(host)
        if port + count - 1 <= 65535 and all(binds(host, port + i) for i in range(1, count)):
            return port
    raise AssertionError(f"no {count} consecutive free ports on {host}")


SNAPSHOT_PERIOD_S = 0.6  # > serving.engine_loop.SNAPSHOT_EVERY_S: the gauges are at most this old


def kv_config(role: str, rank: int, size: int, port: int, **extra) -> str:
    """A ``--kv-transfer-config`` JSON value (``extra``: ``kv_connector_extra_config`` keys)."""
    config = {"kv_role": role, "kv_rank": rank, "kv_parallel_size": size, "kv_port": port}
    if extra:
        config["kv_connector_extra_config"] = extra
    return json.dumps(config)


@contextlib.contextmanager
def running_replica_pd(path: str, serve_args: tuple[str, ...], log_dir):
    """A ``-dp 2`` producer (kv_rank 0) and consumer (kv_rank 1) on ``path`` with ``serve_args``
    after :data:`SERVE_ARGS`, and ``dcpgraph proxy`` in front: yields ``(producer, consumer, proxy)``;
    logs ``p.log``, ``d.log``, ``proxy.log`` in ``log_dir``; all three stopped on exit."""
    from .server import running_dcpgraph, running_servers

    port = consecutive_free_ports(2)
    sides = [((path, *SERVE_ARGS, *serve_args, "--kv-transfer-config", kv_config(role, rank, 2, port)),
              str(log_dir / log)) for role, rank, log in (("kv_producer", 0, "p.log"), ("kv_consumer", 1, "d.log"))]
    with running_servers(*sides) as (p, d), \
            running_dcpgraph("proxy", "--prefill", p.url, "--decode", d.url, log_path=str(log_dir / "proxy.log")) as proxy:
        yield p, d, proxy


def kv_usage(server) -> list[float]:
    """The engine's ``vllm:kv_cache_usage_perc`` and each rank's ``dcpgraph:kv_cache_usage_perc_per_rank``."""
    from .prometheus import scrape

    return scrape(server, "vllm:kv_cache_usage_perc") + scrape(server, "dcpgraph:kv_cache_usage_perc_per_rank")


def kv_stats(server) -> dict:
    import httpx

    return httpx.get(server.url + "/kv_transfer/stats", timeout=10).json()


def wait_kv_free(*servers, timeout_s: float = 60) -> None:
    """Wait until every server's KV usage is zero on every rank; ``AssertionError`` after ``timeout_s``.
    Starts after one snapshot period, so a gauge read before the last request ran cannot pass it."""
    time.sleep(SNAPSHOT_PERIOD_S)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(set(kv_usage(s)) == {0.0} for s in servers):
            return
        time.sleep(0.25)
    raise AssertionError(f"KV blocks still in use: {[kv_usage(s) for s in servers]}")
