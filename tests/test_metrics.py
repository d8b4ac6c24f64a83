"""``/metrics`` in vLLM's names, read back with ``prometheus_client``'s parser (no server here:
tests/test_serving.py scrapes a running one)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dcpgraph.serving.metrics import FinishedRequest, Metrics, build_1_2_5_buckets, kv_usage
from dcpgraph.testing.prometheus import samples

# what vLLM's sample Grafana dashboard and its v1 loggers export, by sample name
VLLM_SAMPLES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_bucket", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_inference_time_seconds_sum", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:iteration_tokens_total_bucket",
    "vllm:request_max_num_generation_tokens_sum", "vllm:request_params_n_bucket",
    "vllm:request_params_max_tokens_bucket", "vllm:time_per_prefill_token_request_seconds_bucket",
)
IDLE = {"running": 0, "waiting": 0, "kv_usage": [0.0, 0.0], "kv_blocks": [(0, 10), (0, 10)], "prefix_cache": {}}


def test_every_vllm_series_is_there_with_model_name_and_engine_labels():
    text = Metrics("tiny").render(IDLE)
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert set(VLLM_SAMPLES) <= names, sorted(set(VLLM_SAMPLES) - names)
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            assert s.name.startswith(("vllm:", "dcpgraph:")), s.name
            assert (s.labels["model_name"], s.labels["engine"]) == ("tiny", "0"), s
    # nothing vLLM names lives only under dcpgraph:
    assert not {n.removeprefix("dcpgraph:") for n in names if n.startswith("dcpgraph:")} & \
        {n.removeprefix("vllm:") for n in names}
    assert samples(text, "vllm:request_success_total") == [0, 0, 0]  # stop, length, abort pre-created


def test_label_values_are_escaped():
    name = 'my "model"\\v2\nnext'
    text = Metrics(name).render(IDLE)
    assert samples(text, "vllm:num_requests_running", model_name=name) == [0]
    assert '\\"model\\"' in text and "\\\\v2" in text and "\\n" in text


def test_kv_cache_usage_is_one_engine_figure_and_per_rank_detail_is_dcpgraphs():
    snap = {**IDLE, "kv_usage": [0.25, 0.75], "kv_blocks": [(1, 4), (3, 4)]}
    text = Metrics("m").render(snap)
    assert samples(text, "vllm:kv_cache_usage_perc") == [0.5]  # 4 of 8 blocks
    assert samples(text, "dcpgraph:kv_cache_usage_perc_per_rank", rank="1") == [0.75]
    assert kv_usage({"kv_usage": [0.5, 0.5]}) == 0.5 and kv_usage({}) == 0.0


def test_tokens_requests_and_phases_in_vllms_meaning():
    m = Metrics("m", max_model_len=100)
    m.step_done(prompt_tokens=7, generation_tokens=1)  # a request's first token: its prompt counts here
    m.step_done(prompt_tokens=0, generation_tokens=3)  # a verified draft: 3 tokens in one step
    m.step_done(0, 0)  # a step that emitted nothing is no iteration sample
    m.first_token(0.02)
    m.inter_token(0.004)
    m.request_done(FinishedRequest("length", prompt_tokens=7, generation_tokens=4, e2e=1.25, queued=0.5,
                                   prefill=0.25, decode=0.5, max_tokens=4))
    m.request_done(FinishedRequest("abort", prompt_tokens=3, generation_tokens=0, e2e=0.1, queued=None,
                                   prefill=None, decode=None))
    m.parent_done(n=2, max_generated=4)
    text = m.render({**IDLE, "scheduler": {"preemptions": 3}, "prefix_cache": {"query_tokens": 9, "hit_tokens": 4},
                     "forwards": {"work": 5, "dummy": 2}})
    assert samples(text, "dcpgraph:model_forwards_total", kind="work") == [5]
    assert samples(text, "dcpgraph:model_forwards_total", kind="dummy") == [2]
    assert samples(text, "vllm:prompt_tokens_total") == [7]
    assert samples(text, "vllm:generation_tokens_total") == [4]
    assert samples(text, "vllm:iteration_tokens_total_count") == [2]
    assert samples(text, "vllm:iteration_tokens_total_sum") == [11]
    assert samples(text, "vllm:request_success_total", finished_reason="length") == [1]
    assert samples(text, "vllm:request_success_total", finished_reason="abort") == [1]
    assert samples(text, "vllm:e2e_request_latency_seconds_sum") == [1.35]
    assert samples(text, "vllm:request_queue_time_seconds_sum") == [0.5]  # the abort never got scheduled
    assert samples(text, "vllm:request_prefill_time_seconds_sum") == [0.25]
    assert samples(text, "vllm:request_decode_time_seconds_sum") == [0.5]
    assert samples(text, "vllm:request_inference_time_seconds_sum") == [0.75]
    assert samples(text, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx([0.5 / 3])
    assert samples(text, "vllm:request_prompt_tokens_count") == [2]
    assert samples(text, "vllm:request_params_n_sum") == [2]
    assert samples(text, "vllm:num_preemptions_total") == [3]
    assert (samples(text, "vllm:prefix_cache_queries_total"), samples(text, "vllm:prefix_cache_hits_total")) == ([9], [4])
    assert samples(text, "vllm:request_generation_tokens_bucket", le="5.0") == [2]  # 0 and 4 tokens
    assert samples(text, "vllm:time_to_first_token_seconds_bucket", le="0.02") == [1]


def test_buckets_are_vllms():
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(4096)[-1] == 2000
    text = Metrics("m", max_model_len=256).render(IDLE)
    les = [float(v) for v in [s.labels["le"] for f in text_string_to_metric_families(text) for s in f.samples
                              if s.name == "vllm:request_prompt_tokens_bucket"]]
    assert les == [1, 2, 5, 10, 20, 50, 100, 200, float("inf")]


def test_two_replicas_report_under_their_own_engine_label(checkpoints):
    """``-dp 2``'s metrics: the real engine loop over a :class:`DataParallelEngine` of two
    in-process engines (the worker groups of ``serve -dp 2`` answer the same client calls). Each
    replica's requests, tokens and phases are counted under ``engine="0"`` or ``"1"``, and the
    per-engine figures sum to what the clients received."""
    import asyncio

    from dcpgraph import LLM
    from dcpgraph.serving.data_parallel import DataParallelEngine
    from dcpgraph.serving.engine_config import build_engine
    from dcpgraph.serving.engine_loop import EngineLoop
    from dcpgraph.serving.params import SamplingParams

    llm = LLM(checkpoints["qwen3"], dtype="float32", max_model_len=64, block_size=4)
    llm.engine = DataParallelEngine([build_engine(llm.config), build_engine(llm.config)])
    metrics = Metrics("m", max_model_len=64, engines=llm.engine.engine_count)
    loop_thread = EngineLoop(llm, metrics)
    lengths = [5, 3, 4]

    async def run() -> list[tuple[int, int]]:
        outs = [asyncio.Queue() for _ in lengths]
        params = SamplingParams(temperature=0.0, max_tokens=8)
        for i, n in enumerate(lengths):  # all three in flight: replicas 0, 1, then 0 (fewest live first)
            await loop_thread.submit(list(range(3, 3 + 4 * (i + 1))), params, n, 0, 0, outs[i], f"r{i}")
        got = []
        for out in outs:
            tokens, engine = 0, None
            while True:
                piece = await out.get()
                tokens, engine = tokens + len(piece.token_ids), piece.engine
                if piece.finished:
                    break
            got.append((engine, tokens))
        return got

    try:
        got = asyncio.run(run())
        assert [e for e, _ in got] == [0, 1, 0] and [t for _, t in got] == lengths
        loop_thread._snapshot_at = 0.0  # let the next pass refresh the gauges at once
        import time

        time.sleep(0.5)
        text = metrics.render(loop_thread.snapshot())
    finally:
        loop_thread.stop()
    for engine in (0, 1):
        mine = [t for e, t in got if e == engine]
        assert samples(text, "vllm:generation_tokens_total", engine=str(engine)) == [sum(mine)]
        assert samples(text, "vllm:request_success_total", engine=str(engine), finished_reason="length") == [len(mine)]
        assert samples(text, "vllm:e2e_request_latency_seconds_count", engine=str(engine)) == [len(mine)]
        assert samples(text, "vllm:num_requests_running", engine=str(engine)) == [0]
        assert len(samples(text, "vllm:kv_cache_usage_perc", engine=str(engine))) == 1
    assert samples(text, "vllm:prompt_tokens_total", engine="0") == [4 + 12]
    assert samples(text, "vllm:prompt_tokens_total", engine="1") == [8]
