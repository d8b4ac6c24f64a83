"""The capacity figures ``benchmarks/peer_capacity.py`` reads from the two servers (no server, no
vLLM needed): vLLM's start-up capacity line and ``/metrics`` cache info, dcpgraph's start-up KV
line and ``/metrics``, and the one count both go through (usable blocks ÷ blocks per request).

References: vLLM 0.32's own format string for its line (and, where vLLM's venv is installed, the
check that its source still has it), dcpgraph's own formatter and exposition, a hand-written
allocation loop and :func:`dcpgraph.capacity.max_sequences` for the count.
"""

from __future__ import annotations

import math

import pytest

from dcpgraph.capacity import max_sequences
from dcpgraph.config import DcpgraphConfig
from dcpgraph.serving.cli import kv_sizing_line
from dcpgraph.serving.metrics import Metrics, cache_config_info
from dcpgraph.testing.peer_capacity import (
    KvCapacity,
    dcpgraph_capacity,
    metrics_point,
    parse_dcpgraph_capacity,
    parse_vllm_capacity,
    vllm_budget_bytes,
    vllm_capacity,
)
from dcpgraph.testing.vllm_bench import vllm_venv

# vllm/v1/core/kv_cache_utils.py (0.32.0), update_kv_cache_capacity's logger.info_once format
VLLM_FORMAT = "%s KV cache size: %s tokens, Maximum concurrency for %s tokens per request: %.2fx"
# and the prefix vLLM's logger puts before it in an engine-core process
VLLM_PREFIX = "(EngineCore pid=4242) INFO 12-05 03:20:11 [kv_cache_utils.py:2327] "


def vllm_line(num_blocks: int, block_size: int, max_model_len: int) -> str:
    """The line as vLLM 0.32 writes it for one full-attention group: concurrency = blocks ÷
    blocks per request, tokens = int(concurrency · max_model_len), thousands separators."""
    concurrency = num_blocks / math.ceil(max_model_len / block_size)
    return VLLM_PREFIX + VLLM_FORMAT % ("CPU", f"{int(concurrency * max_model_len):,}", f"{max_model_len:,}",
                                        concurrency)


def test_a_real_vllm_capacity_line_is_parsed():
    """As vLLM 0.32 -tp 2 wrote it on this machine (2 layers, one KV head, 655,360 bytes per rank)."""
    log = ("(Worker_TP0 pid=15450) INFO 12-05 03:26:37 [cpu_worker.py:260] Explicitly set (0.0/23.54) GiB for KV "
           "cache on node 0.\n(EngineCore pid=15348) INFO 12-05 03:26:37 [kv_cache_utils.py:2327] CPU KV cache size: "
           "640 tokens, Maximum concurrency for 256 tokens per request: 2.50x\n")
    line = parse_vllm_capacity(log)
    assert (line.pool, line.tokens, line.per_request, line.concurrency) == ("CPU", 640, 256, 2.5)
    # 5 blocks of 128 (2.50x), of which the null block leaves 4: two requests of 256 tokens ran at once
    assert line.tokens // 128 == 5 and KvCapacity(5, 128, 1, 1).requests(256) == 2


def test_vllm_capacity_line_is_parsed():
    log = "INFO something else\n" + vllm_line(261, 128, 8320) + "\nINFO later\n"
    line = parse_vllm_capacity(log)
    assert (line.pool, line.per_request, line.concurrency) == ("CPU", 8320, 4.02)
    assert line.tokens == 33408  # "33,408": the separator is dropped
    assert parse_vllm_capacity(VLLM_PREFIX + VLLM_FORMAT % ("GPU + host", "1,234,567", "131,072", 9.42)).pool == \
        "GPU + host"
    with pytest.raises(ValueError, match="no 'KV cache size"):
        parse_vllm_capacity("INFO Maximum concurrency for 8,320 tokens per request\n")


@pytest.mark.skipif(not any(vllm_venv().glob("lib/python3*/site-packages/vllm/v1/core/kv_cache_utils.py")),
                    reason=f"vLLM's venv is not at {vllm_venv()} (docs/testing.md installs it); with it this "
                           "checks that its source still writes the line in this format")
def test_installed_vllm_writes_the_line_in_this_format():
    source_path = next(vllm_venv().glob("lib/python3*/site-packages/vllm/v1/core/kv_cache_utils.py"))
    source = source_path.read_text()
    head, tail = VLLM_FORMAT.split(", ")
    assert f'"{head}, "' in source and f'"{tail}"' in source  # the format is two adjacent literals
    assert "num_blocks / num_blocks_per_request" in source.replace("kv_cache_config.num_blocks", "num_blocks")
    pool = (source_path.parent / "block_pool.py").read_text()
    assert "self.null_block = self.free_block_queue.popleft()" in pool  # the block no request gets


def test_dcpgraph_capacity_line_is_parsed_from_its_own_formatter():
    memory = {"num_blocks": 2088, "block_size": 16, "kv_bytes_per_rank": [2088 * 32768] * 2,
              "kv_capacity_tokens": 2088 * 16 * 2, "kv_sizing": {"policy": "cache_size", "num_blocks": 2088}}
    log = "2026-12-05 03:00:00,000 INFO dcpgraph.serving: KV cache: " + kv_sizing_line(memory) + "\n"
    line = parse_dcpgraph_capacity(log)
    assert (line.blocks, line.block_size, line.tokens) == (2088, 16, 66816)
    with pytest.raises(ValueError, match="no 'KV cache: N blocks"):
        parse_dcpgraph_capacity("KV cache: as given\n")


def test_dcpgraph_metrics_give_its_blocks_dcp_and_running_counts():
    config = DcpgraphConfig.from_llm_kwargs(model="/m", tensor_parallel_size=2, decode_context_parallel_size=2,
                                            block_size=16)
    text = Metrics("peer", cache_config_info(config, 2088)).render(
        {"running": 7, "waiting": 2, "kv_usage": [0.5, 0.5], "scheduler": {"preemptions": 3}})
    kv = dcpgraph_capacity(text)
    assert kv == KvCapacity(num_blocks=2088, block_size=16, dcp=2, reserved_blocks=0)
    assert (kv.usable_tokens, kv.requests(8192 + 128)) == (66816, 8)
    assert metrics_point(text) == (7, 2, 3)


# vLLM 0.32's /metrics at -tp 2 on this machine (the --quick smoke run's start-up scrape; the
# running count and preemptions set by hand, cache_config_info's other 20 labels left out)
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="peer"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="peer"} 0.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="peer",reason="capacity"} 0.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="peer"} 1.0
vllm:num_preemptions_created{engine="0",model_name="peer"} 1.796441868782426e+09
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{_block_size_resolved="True",block_size="128",cache_dtype="auto",enable_prefix_caching="True",\
engine="0",kv_cache_max_concurrency="2.5",kv_cache_memory_bytes="655360",kv_cache_size_tokens="640",\
num_cpu_blocks="None",num_gpu_blocks="5",num_gpu_blocks_override="None"} 1.0
"""


def test_vllm_metrics_give_its_blocks_less_the_null_block():
    kv = vllm_capacity(VLLM_METRICS)
    assert kv == KvCapacity(num_blocks=5, block_size=128, dcp=1, reserved_blocks=1)
    # its own figures count the null block: 640 tokens, 2.5 requests; 2 of 256 tokens fit
    assert (kv.usable_tokens, kv.requests(256)) == (512, 2)
    assert metrics_point(VLLM_METRICS) == (2, 0, 1)
    # the 8K budget: 261 blocks read 4.02x and admit 4; one block fewer still reads 4.00x but admits 3
    assert parse_vllm_capacity(vllm_line(260, 128, 8320)).concurrency == 4.0
    assert (KvCapacity(261, 128, 1, 1).requests(8320), KvCapacity(260, 128, 1, 1).requests(8320)) == (4, 3)


def admitted_by_hand(num_blocks: int, reserved: int, tokens_per_block: int, tokens: int) -> int:
    """Give requests of ``tokens`` tokens whole blocks one block at a time until one cannot finish."""
    free, admitted = num_blocks - reserved, 0
    while True:
        need = 0
        while need * tokens_per_block < tokens:
            need += 1
        if need > free:
            return admitted
        free -= need
        admitted += 1


@pytest.mark.parametrize("blocks,block_size,dcp,reserved,tokens", [
    (2088, 16, 2, 0, 8320), (261, 128, 1, 1, 8320), (260, 128, 1, 1, 8320), (40, 16, 2, 0, 256),
    (5, 128, 1, 1, 256), (100, 16, 2, 0, 8300), (7, 128, 1, 1, 129), (3, 16, 1, 0, 1000)])
def test_the_count_is_whole_blocks_per_request(blocks, block_size, dcp, reserved, tokens):
    kv = KvCapacity(blocks, block_size, dcp, reserved)
    assert kv.requests(tokens) == admitted_by_hand(blocks, reserved, block_size * dcp, tokens)
    assert kv.requests(tokens) == max_sequences(blocks - reserved, tokens, block_size, dcp)
    if tokens % (block_size * dcp) == 0:  # aligned: tokens the space holds ÷ tokens per request
        assert kv.requests(tokens) == kv.usable_tokens // tokens


def test_the_default_budget_holds_the_vllm_count_and_twice_it_with_dcp():
    """The 8K run's budget: 4 vLLM requests of 8,192 + 512 tokens plus the null block per rank.
    vLLM keeps the one KV head on both ranks; dcpgraph tp2·dcp2 keeps half of each request's tokens."""
    shape = {"layers": 4, "kv_heads": 1, "head_dim": 64}
    budget = vllm_budget_bytes(shape, tp=2, dtype="float32", tokens=8704, requests=4)
    vllm_block = 4 * 2 * 128 * 1 * 64 * 4  # layers · (K, V) · tokens · heads · dim · fp32
    assert budget == (4 * 68 + 1) * vllm_block == 71_565_312
    assert KvCapacity(budget // vllm_block, 128, 1, 1).requests(8704) == 4
    dcpgraph_block = 4 * 2 * 16 * 1 * 64 * 4
    assert KvCapacity(budget // dcpgraph_block, 16, 2, 0).requests(8704) == 8
    # a model with as many KV heads as tp: nothing replicated, one head per rank either way
    assert vllm_budget_bytes({**shape, "kv_heads": 2}, 2, "float32", 8704, 4) == budget
