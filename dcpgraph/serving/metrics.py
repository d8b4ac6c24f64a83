"""Prometheus text exposition of the server's counters, gauges and histograms (no client library).

Names follow vLLM's with the ``dcpgraph:`` prefix. Gauges come from the engine loop's snapshot
(:meth:`EngineLoop.snapshot`); "running" requests have produced a token, "waiting" ones are queued
or still in prefill.
"""

from __future__ import annotations

import threading

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out = [f'{name}_bucket{{{labels},le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        return out + [f"{name}_sum{{{labels}}} {self.total}", f"{name}_count{{{labels}}} {self.count}"]


def cache_config_info(settings, num_blocks: int) -> dict[str, str]:
    """vLLM's ``cache_config_info`` labels for a :class:`~dcpgraph.config.DcpgraphConfig` and the
    ``num_blocks`` per rank its engine allocated: the KV cache as the server was started
    (``cache_dtype`` as given: ``auto`` is the model's dtype)."""
    cache, parallel = settings.cache, settings.parallel
    return {
        "block_size": str(cache.block_size),
        "cache_dtype": str(cache.kv_cache_dtype),
        "enable_prefix_caching": str(bool(cache.enable_prefix_caching)),
        "num_gpu_blocks": str(num_blocks),
        "tensor_parallel_size": str(parallel.tensor_parallel_size),
        "decode_context_parallel_size": str(parallel.decode_context_parallel_size),
        "cp_kv_cache_interleave_size": str(parallel.cp_kv_cache_interleave_size),
        "backend": str(settings.compilation.effective_backend),
    }


class Metrics:
    def __init__(self, model_name: str, cache_info: dict[str, str] | None = None):
        self.model_name = model_name
        self.cache_info = dict(cache_info or {})
        self.lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)

    def request_done(self, prompt_tokens: int, generated: int, reason: str, ttft: float | None,
                     tpot: float | None) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generated
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if ttft is not None:
                self.ttft.observe(ttft)
            if tpot is not None:
                self.tpot.observe(tpot)

    @staticmethod
    def _speculative(metric, labels: str, spec: dict) -> None:
        """vLLM's ``spec_decode_*`` counters from ``Engine.report()["speculative"]`` (absent
        without speculation): verified rows ("drafts"), draft tokens, accepted tokens, accepted
        tokens per draft position."""
        if not spec.get("method"):
            return
        metric("spec_decode_num_drafts_total", "counter", "Verified rows that carried drafts.",
               [f"dcpgraph:spec_decode_num_drafts_total{{{labels}}} {spec['verified_rows']}"])
        metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.",
               [f"dcpgraph:spec_decode_num_draft_tokens_total{{{labels}}} {spec['drafted']}"])
        metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
               [f"dcpgraph:spec_decode_num_accepted_tokens_total{{{labels}}} {spec['accepted']}"])
        metric("spec_decode_num_accepted_tokens_per_pos_total", "counter", "Accepted draft tokens by position.",
               [f'dcpgraph:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{j}"}} {n}'
                for j, n in enumerate(spec["accepted_per_position"])])

    def render(self, snapshot: dict) -> str:
        labels = f'model_name="{self.model_name}"'
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, values: list[str]) -> None:
            lines.extend([f"# HELP dcpgraph:{name} {help_text}", f"# TYPE dcpgraph:{name} {kind}", *values])

        if self.cache_info:
            info = ",".join(f'{k}="{v}"' for k, v in self.cache_info.items())
            metric("cache_config_info", "gauge", "The KV cache configuration the server was started with.",
                   [f"dcpgraph:cache_config_info{{{labels},{info}}} 1"])
        metric("num_requests_running", "gauge", "Requests that have produced a token and are not finished.",
               [f"dcpgraph:num_requests_running{{{labels}}} {snapshot['running']}"])
        metric("num_requests_waiting", "gauge", "Requests queued or in prefill (no token yet).",
               [f"dcpgraph:num_requests_waiting{{{labels}}} {snapshot['waiting']}"])
        metric("kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use, per rank.",
               [f'dcpgraph:kv_cache_usage_perc{{{labels},rank="{r}"}} {u}' for r, u in enumerate(snapshot["kv_usage"])])
        cache = snapshot.get("prefix_cache", {})
        metric("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
               [f"dcpgraph:prefix_cache_queries_total{{{labels}}} {cache.get('query_tokens', 0)}"])
        metric("prefix_cache_hits_total", "counter", "Prompt tokens served from the prefix cache.",
               [f"dcpgraph:prefix_cache_hits_total{{{labels}}} {cache.get('hit_tokens', 0)}"])
        metric("prefix_cache_preempted_queries_total", "counter",
               "Tokens looked up in the prefix cache by requests re-admitted after a preemption.",
               [f"dcpgraph:prefix_cache_preempted_queries_total{{{labels}}} {cache.get('preempted_query_tokens', 0)}"])
        metric("prefix_cache_preempted_hits_total", "counter",
               "Tokens served from the prefix cache to requests re-admitted after a preemption.",
               [f"dcpgraph:prefix_cache_preempted_hits_total{{{labels}}} {cache.get('preempted_hit_tokens', 0)}"])
        self._speculative(metric, labels, snapshot.get("speculative") or {})
        with self.lock:
            metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   [f"dcpgraph:prompt_tokens_total{{{labels}}} {self.prompt_tokens}"])
            metric("generation_tokens_total", "counter", "Tokens generated for finished requests.",
                   [f"dcpgraph:generation_tokens_total{{{labels}}} {self.generation_tokens}"])
            metric("request_success_total", "counter", "Finished requests by finish reason.",
                   [f'dcpgraph:request_success_total{{{labels},finished_reason="{k}"}} {v}'
                    for k, v in sorted(self.finished.items())])
            metric("time_to_first_token_seconds", "histogram", "Time to first token.",
                   self.ttft.lines("dcpgraph:time_to_first_token_seconds", labels))
            metric("time_per_output_token_seconds", "histogram", "Mean time per output token after the first.",
                   self.tpot.lines("dcpgraph:time_per_output_token_seconds", labels))
        return "\n".join(lines) + "\n"
