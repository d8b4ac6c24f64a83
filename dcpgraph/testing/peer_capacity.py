"""How many requests of ``L`` tokens each fit at once in a server's KV cache, read the same way
from ``dcpgraph serve`` and from ``vllm serve`` (vLLM's CPU build), and a watch on ``/metrics``
that shows whether a server really ran that many together.

Both servers page their KV cache in blocks and give a request whole blocks, so the count is::

    usable_blocks    = num_blocks - reserved_blocks
    tokens_per_block = block_size · dcp                 (a dcpgraph virtual block; dcp = 1 for vLLM)
    blocks_per_request = ceil(L / tokens_per_block)
    capacity         = usable_blocks // blocks_per_request

which is ``floor(usable_blocks · tokens_per_block / L)`` (tokens the KV space holds ÷ tokens per
request) whenever ``L`` is a multiple of ``tokens_per_block``. ``num_blocks`` is per rank for both:
vLLM's CPU worker sizes its cache from ``--kv-cache-memory-bytes`` (``VLLM_CPU_KVCACHE_SPACE`` GiB
is turned into the same setting) per worker, each worker holding its own copy of the KV heads it
needs (a KV head is replicated on every TP rank when there are fewer KV heads than ranks), and the
engine takes the smallest count over the workers; dcpgraph's ``--kv-cache-memory-bytes`` is per
rank too, and a dcpgraph block of ``block_size`` tokens on each of a DCP group's ``dcp`` ranks is one
virtual block of ``block_size · dcp`` tokens. ``reserved_blocks`` is 1 for vLLM: its block pool
takes one block out as the "null block" (``BlockPool.null_block``) and never hands it to a request,
while its start-up line "Maximum concurrency for L tokens per request: X.XXx" divides all
``num_blocks`` (``get_max_concurrency_for_kv_cache_config``), so that line's figure can exceed
what it admits by up to one block's worth. dcpgraph reserves none for a model like this one
(a scratch block only for DeepSeek-V4's compressed layers).
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .prometheus import samples

# vLLM 0.32 ``update_kv_cache_capacity`` (vllm/v1/core/kv_cache_utils.py):
#   "%s KV cache size: %s tokens, Maximum concurrency for %s tokens per request: %.2fx"
# with the device name ("CPU", "GPU", "+ host" appended for a host pool) and both counts
# formatted with thousands separators.
VLLM_CAPACITY_LINE = re.compile(
    r"(?P<pool>[A-Z]+(?: \+ host)?) KV cache size: (?P<tokens>[\d,]+) tokens, "
    r"Maximum concurrency for (?P<per_request>[\d,]+) tokens per request: (?P<concurrency>[\d.]+)x")
# dcpgraph serve's start-up line (dcpgraph.serving.cli.kv_sizing_line):
#   "KV cache: N blocks per rank of B tokens, <size> per rank, T tokens (...)"
DCPGRAPH_CAPACITY_LINE = re.compile(
    r"KV cache: (?P<blocks>\d+) blocks per rank of (?P<block_size>\d+) tokens, [^,]+ per rank, "
    r"(?P<tokens>\d+) tokens")
VLLM_NULL_BLOCKS = 1
VLLM_BLOCK_SIZE = 128  # vLLM CPU's default (CpuPlatform.check_and_update_config)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class VllmCapacityLine:
    """vLLM's start-up capacity line: ``tokens`` = ``int(concurrency · per_request)``."""

    pool: str
    tokens: int
    per_request: int
    concurrency: float


def parse_vllm_capacity(log: str) -> VllmCapacityLine:
    """The first capacity line in a ``vllm serve`` log; ``ValueError`` if there is none."""
    m = VLLM_CAPACITY_LINE.search(log)
    if m is None:
        raise ValueError("no 'KV cache size: ... Maximum concurrency for ...' line in the vLLM log")
    return VllmCapacityLine(m["pool"], int(m["tokens"].replace(",", "")), int(m["per_request"].replace(",", "")),
                            float(m["concurrency"]))


@dataclass(frozen=True)
class DcpgraphCapacityLine:
    """dcpgraph's start-up KV line: blocks per rank, tokens per physical block, tokens in all."""

    blocks: int
    block_size: int
    tokens: int


def parse_dcpgraph_capacity(log: str) -> DcpgraphCapacityLine:
    """The first ``KV cache: N blocks per rank ...`` line in a ``dcpgraph serve`` log."""
    m = DCPGRAPH_CAPACITY_LINE.search(log)
    if m is None:
        raise ValueError("no 'KV cache: N blocks per rank of B tokens' line in the dcpgraph log")
    return DcpgraphCapacityLine(int(m["blocks"]), int(m["block_size"]), int(m["tokens"]))


@dataclass(frozen=True)
class KvCapacity:
    """One server's KV cache as the module docstring counts it."""

    num_blocks: int  # per rank, as the server reports it
    block_size: int  # tokens of one physical block on one rank
    dcp: int = 1
    reserved_blocks: int = 0  # never given to a request (vLLM's null block)

    @property
    def tokens_per_block(self) -> int:
        return self.block_size * self.dcp

    @property
    def usable_tokens(self) -> int:
        """Tokens the blocks a request can get hold, all requests together."""
        return (self.num_blocks - self.reserved_blocks) * self.tokens_per_block

    def blocks_per_request(self, tokens: int) -> int:
        return math.ceil(tokens / self.tokens_per_block)

    def requests(self, tokens: int) -> int:
        """How many requests of ``tokens`` tokens (prompt + output) hold their blocks at once."""
        if tokens < 1:
            raise ValueError(f"a request holds at least one token, got {tokens}")
        return max(0, self.num_blocks - self.reserved_blocks) // self.blocks_per_request(tokens)


def cache_config_info(metrics_text: str) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` in a ``/metrics`` text (both servers export it)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == "vllm:cache_config_info":
                return dict(s.labels)
    raise ValueError("no vllm:cache_config_info sample in the /metrics text")


def vllm_capacity(metrics_text: str) -> KvCapacity:
    """vLLM's cache from its ``/metrics``: ``num_gpu_blocks`` and ``block_size`` of
    ``cache_config_info``, one block reserved (the null block)."""
    info = cache_config_info(metrics_text)
    return KvCapacity(int(info["num_gpu_blocks"]), int(info["block_size"]), 1, VLLM_NULL_BLOCKS)


def dcpgraph_capacity(metrics_text: str) -> KvCapacity:
    """dcpgraph's cache from its ``/metrics``: ``num_gpu_blocks`` per rank, ``block_size`` and
    ``decode_context_parallel_size`` of ``cache_config_info``."""
    info = cache_config_info(metrics_text)
    return KvCapacity(int(info["num_gpu_blocks"]), int(info["block_size"]),
                      int(info.get("decode_context_parallel_size") or 1), 0)


def checkpoint_shape(model_dir: str) -> dict:
    """The figures of a checkpoint's ``config.json`` that size its KV cache."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config["num_attention_heads"]
    return {"layers": config["num_hidden_layers"], "kv_heads": config.get("num_key_value_heads", heads),
            "head_dim": config.get("head_dim") or config["hidden_size"] // heads}


def vllm_budget_bytes(shape: dict, tp: int, dtype: str, tokens: int, requests: int) -> int:
    """Per-rank bytes for ``requests`` requests of ``tokens`` tokens in vLLM's CPU cache, plus its
    null block: a block holds K and V of ``VLLM_BLOCK_SIZE`` tokens of every layer, with
    ``max(1, kv_heads // tp)`` KV heads per rank (a head is replicated when there are fewer than tp)."""
    heads = max(1, shape["kv_heads"] // tp)
    per_block = shape["layers"] * 2 * VLLM_BLOCK_SIZE * heads * shape["head_dim"] * DTYPE_BYTES[dtype]
    return (requests * -(-tokens // VLLM_BLOCK_SIZE) + 1) * per_block


@dataclass
class RunningPeak:
    """What :func:`watch_running` saw: the most requests running at once, the most waiting, and
    the preemptions counted while it watched (``vllm:num_preemptions_total``'s rise)."""

    peak_running: int = 0
    peak_waiting: int = 0
    preemptions: int = 0
    polls: int = 0
    errors: list[str] = field(default_factory=list)


def metrics_point(metrics_text: str) -> tuple[int, int, int]:
    """``(running, waiting, preemptions so far)`` from one ``/metrics`` text, summed over the
    samples (one per engine)."""
    def total(name: str) -> int:
        return int(sum(samples(metrics_text, name)))

    return (total("vllm:num_requests_running"), total("vllm:num_requests_waiting"),
            total("vllm:num_preemptions_total"))


class watch_running:
    """Poll ``url + "/metrics"`` every ``period_s`` in a thread while the ``with`` block runs;
    the block gets the :class:`RunningPeak` (filled in when the block exits)."""

    def __init__(self, url: str, period_s: float = 0.2):
        self.url, self.period_s = url, period_s
        self.peak = RunningPeak()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._first: int | None = None
        self._last = 0

    def _poll(self) -> None:
        import httpx

        while True:
            try:
                running, waiting, preempted = metrics_point(httpx.get(self.url + "/metrics", timeout=10).text)
            except Exception as err:  # a slow or failed scrape: note it, keep watching
                self.peak.errors.append(f"{type(err).__name__}: {err}")
            else:
                self.peak.polls += 1
                self.peak.peak_running = max(self.peak.peak_running, running)
                self.peak.peak_waiting = max(self.peak.peak_waiting, waiting)
                self._first = preempted if self._first is None else self._first
                self._last = preempted
            if self._stop.wait(self.period_s):
                return

    def __enter__(self) -> RunningPeak:
        self._thread.start()
        return self.peak

    def __exit__(self, *exc) -> None:
        time.sleep(self.period_s)  # one more scrape after the load ends: the preemption count settles
        self._stop.set()
        self._thread.join(timeout=30)
        self.peak.preemptions = self._last - (self._first or 0)
