"""The server's Prometheus metrics, with vLLM's names, through ``prometheus_client``.

Every metric vLLM's v1 engine exports (``vllm/v1/metrics/loggers.py``) that dcpgraph can measure
is exported under vLLM's name, type, labels (``model_name``, ``engine``) and buckets, so vLLM's
Grafana dashboards and scrapers work unchanged; what only dcpgraph has (per-rank KV use, prefix
cache use by re-admitted requests) is under ``dcpgraph:``. ``prometheus_client`` writes the text
(label values escaped) into a registry of this server's own (several servers in one process never
share series). Invariants:

- ``vllm:kv_cache_usage_perc`` is ONE value per engine: blocks in use over blocks allocated, summed
  over every rank of the deployment (the ranks of one engine share one block table, so it equals
  each rank's fraction); ``dcpgraph:kv_cache_usage_perc_per_rank{rank}`` has the detail;
- counters only grow: the event counters are incremented by the engine loop as tokens come out
  (vLLM's semantics: a request's prompt tokens count at its first token, every emitted token is a
  generation token, aborted requests included), the engine's own totals (prefix cache,
  preemptions, speculation) are exported as read from ``Engine.report()``;
- gauges come from the engine loop's snapshot (:meth:`EngineLoop.snapshot`, at most
  ``SNAPSHOT_EVERY_S`` old): "running" requests have been scheduled by the engine (a preempted
  one stays running), "waiting" ones have not been yet.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest

# vLLM's buckets (loggers.py), by what they measure
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
PREFILL_TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort")  # pre-created at 0, as vLLM does
# The ``engine`` label: the engine's index, "0" to "D-1" with D data-parallel replicas (vLLM's
# per-DP-rank label); the ranks of one replica are one engine.
# Prometheus' classic text format, whatever the scrape's Accept says: prometheus_client's OpenMetrics
# encoder rewrites ``vllm:x`` as ``vllm_x`` for scrapers that do not ask for UTF-8 names (Prometheus 2)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

prometheus_client.disable_created_metrics()  # no ``*_created`` series (vLLM's exposition has none)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


def cache_config_info(settings, num_blocks: int, kv_sizing: dict | None = None) -> dict[str, str]:
    """vLLM's ``cache_config_info`` labels for a :class:`~dcpgraph.config.DcpgraphConfig` and the
    ``num_blocks`` per rank its engine allocated: the KV cache as the server was started
    (``cache_dtype`` as given: ``auto`` is the model's dtype). ``kv_sizing`` (the engine's
    ``memory_report()["kv_sizing"]``) adds the memory fraction applied and the KV bytes per rank it
    left (``gpu_memory_utilization`` "None" and ``kv_cache_memory_bytes`` empty when a cache size
    or the default chose the count)."""
    cache, parallel = settings.cache, settings.parallel
    by_fraction = (kv_sizing or {}).get("policy") == "gpu_memory_utilization"
    return {
        "gpu_memory_utilization": str(kv_sizing["utilization"] if by_fraction else None),
        "kv_cache_memory_bytes": str(kv_sizing["kv_bytes"]) if by_fraction else "",
        "block_size": str(cache.block_size),
        "cache_dtype": str(cache.kv_cache_dtype),
        "enable_prefix_caching": str(bool(cache.enable_prefix_caching)),
        "num_gpu_blocks": str(num_blocks),
        "tensor_parallel_size": str(parallel.tensor_parallel_size),
        "decode_context_parallel_size": str(parallel.decode_context_parallel_size),
        "cp_kv_cache_interleave_size": str(parallel.cp_kv_cache_interleave_size),
        "backend": str(settings.compilation.effective_backend),
    }


@dataclass(frozen=True)
class FinishedRequest:
    """One finished (or aborted) engine request, in vLLM's phases (seconds, monotonic clock):
    queued = scheduled − arrived, prefill = first token − scheduled, decode = last token − first
    token, inference = prefill + decode, e2e = finished − arrived. A request that never got a
    token has ``None`` for the phases it did not reach."""

    finish_reason: str
    prompt_tokens: int
    generation_tokens: int
    e2e: float
    queued: float | None
    prefill: float | None
    decode: float | None
    max_tokens: int | None = None
    engine: int = 0  # the data-parallel replica that ran it (the ``engine`` label)


def kv_usage(snapshot: dict) -> float:
    """The engine's one KV-use fraction: used over total blocks summed over the ranks
    (``snapshot["kv_blocks"]``: ``(used, total)`` per rank); the mean of ``kv_usage`` (fractions of
    equal-sized rank caches) when only that is given."""
    blocks = snapshot.get("kv_blocks")
    if blocks:
        total = sum(t for _, t in blocks)
        return sum(u for u, _ in blocks) / total if total else 0.0
    fractions = list(snapshot.get("kv_usage") or [])
    return sum(fractions) / len(fractions) if fractions else 0.0


class _SnapshotCollector:
    """The snapshot's gauges and the engine's cumulative counters, read at each scrape."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        engines = m.snapshot.get("engines") or [m.snapshot]  # one snapshot per engine, in engine order
        labelled = [([m.model_name, str(e)], snap) for e, snap in enumerate(engines)]
        yield _gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                     [(labels, snap.get("running", 0)) for labels, snap in labelled])
        yield _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                     [(labels, snap.get("waiting", 0)) for labels, snap in labelled])
        usage = [(labels, kv_usage(snap)) for labels, snap in labelled]
        yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield _gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM's older name, which its sample Grafana "
                     "dashboard reads). DEPRECATED: use vllm:kv_cache_usage_perc.", usage)
        per_rank = GaugeMetricFamily("dcpgraph:kv_cache_usage_perc_per_rank", "Fraction of KV blocks in use, per rank.",
                                     labels=["model_name", "engine", "rank"])
        for labels, snap in labelled:
            for rank, value in enumerate(snap.get("kv_usage") or []):
                per_rank.add_metric([*labels, str(rank)], value)
        yield per_rank
        if m.cache_info:
            keys = sorted(m.cache_info)
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                     labels=["model_name", "engine", *keys])
            for labels, _ in labelled:
                info.add_metric([*labels, *(m.cache_info[k] for k in keys)], 1)
            yield info
        yield from _engine_counters(labelled)


def _gauge(name: str, doc: str, values: list[tuple[list[str], float]]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name", "engine"])
    for labels, value in values:
        family.add_metric(labels, value)
    return family


def _counter(name: str, doc: str, values: list[tuple[list[str], float]]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["model_name", "engine"])
    for labels, value in values:
        family.add_metric(labels, value)
    return family


def _engine_counters(labelled: list[tuple[list[str], dict]]) -> Iterable:
    """Totals each engine keeps (``Engine.report()``): prefix cache in tokens, preemptions,
    speculative decoding (only with speculation on)."""
    def per_engine(read) -> list[tuple[list[str], float]]:
        return [(labels, read(snap)) for labels, snap in labelled]

    def cache(key: str):
        return per_engine(lambda snap: (snap.get("prefix_cache") or {}).get(key, 0))

    yield _counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                   cache("query_tokens"))
    yield _counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                   cache("hit_tokens"))
    yield _counter("dcpgraph:prefix_cache_preempted_queries",
                   "Tokens looked up in the prefix cache by requests re-admitted after a preemption.",
                   cache("preempted_query_tokens"))
    yield _counter("dcpgraph:prefix_cache_preempted_hits",
                   "Tokens served from the prefix cache to requests re-admitted after a preemption.",
                   cache("preempted_hit_tokens"))
    yield _counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                   per_engine(lambda snap: (snap.get("scheduler") or {}).get("preemptions", 0)))
    forwards = CounterMetricFamily("dcpgraph:model_forwards", "Forwards the engine ran: kind=work (its scheduled "
                                   "batch) or kind=dummy (a replica sharing the experts with nothing scheduled).",
                                   labels=["model_name", "engine", "kind"])
    for labels, snap in labelled:
        for kind in ("work", "dummy"):
            forwards.add_metric([*labels, kind], (snap.get("forwards") or {}).get(kind, 0))
    yield forwards
    speculating = [(labels, snap["speculative"]) for labels, snap in labelled
                   if (snap.get("speculative") or {}).get("method")]
    if not speculating:
        return
    yield _counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                   [(labels, spec["verified_rows"]) for labels, spec in speculating])
    yield _counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                   [(labels, spec["drafted"]) for labels, spec in speculating])
    yield _counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                   [(labels, spec["accepted"]) for labels, spec in speculating])
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted tokens per draft position.", labels=["model_name", "engine", "position"])
    for labels, spec in speculating:
        for j, n in enumerate(spec["accepted_per_position"]):
            per_pos.add_metric([*labels, str(j)], n)
    yield per_pos


class Metrics:
    """The registry of one server. The engine loop reports tokens (:meth:`step_done`,
    :meth:`first_token`, :meth:`inter_token`) and finished requests (:meth:`request_done`); the
    HTTP layer reports finished client requests (:meth:`parent_done`); :meth:`render` writes
    everything with the latest engine snapshot."""

    def __init__(self, model_name: str, cache_info: dict[str, str] | None = None, max_model_len: int = 4096,
                 engines: int = 1):
        self.model_name = model_name
        self.engines = engines
        self.cache_info = dict(cache_info or {})
        self.snapshot: dict = {}
        self.lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_SnapshotCollector(self))
        self._build(max_model_len)

    def _metric(self, cls, name: str, doc: str, **kwargs) -> list:
        """The metric's child for each engine, by engine index."""
        family = cls(name, doc, ["model_name", "engine"], registry=self.registry, **kwargs)
        return [family.labels(self.model_name, str(e)) for e in range(self.engines)]

    def _build(self, max_model_len: int) -> None:
        lengths = build_1_2_5_buckets(max_model_len)
        h, c = Histogram, Counter
        self.prompt_tokens = self._metric(c, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = self._metric(c, "vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          ["model_name", "engine", "finished_reason"], registry=self.registry)
        self.success = {(e, r): success.labels(self.model_name, str(e), r)
                        for e in range(self.engines) for r in FINISH_REASONS}
        self._success_family = success
        self.request_prompt_tokens = self._metric(h, "vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                                  buckets=lengths)
        self.request_generation_tokens = self._metric(h, "vllm:request_generation_tokens",
                                                      "Number of generation tokens processed.", buckets=lengths)
        self.iteration_tokens = self._metric(h, "vllm:iteration_tokens_total",
                                             "Histogram of number of tokens per engine_step.",
                                             buckets=ITERATION_TOKEN_BUCKETS)
        self.max_generation_tokens = self._metric(h, "vllm:request_max_num_generation_tokens",
                                                  "Histogram of maximum number of requested generation tokens.",
                                                  buckets=lengths)
        self.params_n = self._metric(h, "vllm:request_params_n", "Histogram of the n request parameter.",
                                     buckets=N_BUCKETS)
        self.params_max_tokens = self._metric(h, "vllm:request_params_max_tokens",
                                              "Histogram of the max_tokens request parameter.", buckets=lengths)
        self._build_latencies()

    def _build_latencies(self) -> None:
        h = Histogram
        self.ttft = self._metric(h, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                 buckets=TTFT_BUCKETS)
        self.itl = self._metric(h, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                buckets=TOKEN_LATENCY_BUCKETS)
        self.tpot = self._metric(h, "vllm:time_per_output_token_seconds",
                                 "Histogram of time per output token in seconds (vLLM's older name of "
                                 "vllm:inter_token_latency_seconds, which its sample Grafana dashboard reads).",
                                 buckets=TOKEN_LATENCY_BUCKETS)
        self.request_tpot = self._metric(h, "vllm:request_time_per_output_token_seconds",
                                         "Histogram of time_per_output_token_seconds per request.",
                                         buckets=TOKEN_LATENCY_BUCKETS)
        self.prefill_per_token = self._metric(h, "vllm:time_per_prefill_token_request_seconds",
                                              "Time spent per token during prefill phase in seconds",
                                              buckets=PREFILL_TOKEN_BUCKETS)
        phases = {"e2e": ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
                  "queued": ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
                  "inference": ("vllm:request_inference_time_seconds",
                                "Histogram of time spent in RUNNING phase for request."),
                  "prefill": ("vllm:request_prefill_time_seconds",
                              "Histogram of time spent in PREFILL phase for request."),
                  "decode": ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.")}
        self.phases = {k: self._metric(h, name, doc, buckets=REQUEST_LATENCY_BUCKETS)
                       for k, (name, doc) in phases.items()}

    # -- reports from the engine loop and the HTTP layer ---------------------------------------------
    def step_done(self, prompt_tokens: int, generation_tokens: int, engine: int = 0) -> None:
        """One step of ``engine``: ``prompt_tokens`` of the requests that got their first token in
        it (vLLM counts a prompt there), ``generation_tokens`` emitted by it."""
        with self.lock:
            self.prompt_tokens[engine].inc(prompt_tokens)
            self.generation_tokens[engine].inc(generation_tokens)
            if prompt_tokens + generation_tokens:
                self.iteration_tokens[engine].observe(prompt_tokens + generation_tokens)

    def first_token(self, ttft: float, engine: int = 0) -> None:
        self.ttft[engine].observe(ttft)

    def inter_token(self, gap: float, engine: int = 0) -> None:
        """The time between two steps that emitted tokens for one request (one observation per
        step, however many tokens a verified draft gave)."""
        self.itl[engine].observe(gap)
        self.tpot[engine].observe(gap)

    def request_done(self, r: FinishedRequest) -> None:
        e = r.engine
        with self.lock:
            if (e, r.finish_reason) not in self.success:
                self.success[e, r.finish_reason] = self._success_family.labels(self.model_name, str(e),
                                                                               r.finish_reason)
            self.success[e, r.finish_reason].inc()
        self.phases["e2e"][e].observe(r.e2e)
        if r.queued is not None:
            self.phases["queued"][e].observe(r.queued)
        if r.prefill is not None:
            self.phases["prefill"][e].observe(r.prefill)
            if r.prompt_tokens > 0:
                self.prefill_per_token[e].observe(r.prefill / r.prompt_tokens)
            self.phases["decode"][e].observe(r.decode or 0.0)
            self.phases["inference"][e].observe(r.prefill + (r.decode or 0.0))
        if r.generation_tokens > 1 and r.decode is not None:
            self.request_tpot[e].observe(r.decode / (r.generation_tokens - 1))
        self.request_prompt_tokens[e].observe(r.prompt_tokens)
        self.request_generation_tokens[e].observe(r.generation_tokens)
        if r.max_tokens:
            self.params_max_tokens[e].observe(r.max_tokens)

    def parent_done(self, n: int, max_generated: int, engine: int = 0) -> None:
        """A client request whose ``n`` choices all finished; ``max_generated``: the most tokens
        one of them generated; ``engine``: its first choice's."""
        self.params_n[engine].observe(n)
        self.max_generation_tokens[engine].observe(max_generated)

    # -- exposition ----------------------------------------------------------------------------------
    def render(self, snapshot: dict) -> str:
        """Prometheus' text format (:data:`CONTENT_TYPE`) with ``snapshot``'s gauges."""
        with self.lock:
            self.snapshot = dict(snapshot)
            return generate_latest(self.registry).decode()
