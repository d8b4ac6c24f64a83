"""Data parallelism (``--data-parallel-size``): replicas behind one client.

Default tier: :class:`~dcpgraph.serving.data_parallel.DataParallelEngine` over two in-process
engines (tp=1): requests go to the least busy replica, ids are the client's
own, aborts reach the right replica, and every prompt's tokens equal one engine's. Slow tier, on
real gloo workers: ``LLM(..., data_parallel_size=2)`` at tp=2/dcp=2 (four worker processes) equals
HF's greedy tokens with both replicas serving, and ``dcpgraph serve -dp 2`` answers concurrent
``openai`` clients with HF's text, then fails ``/health`` and new requests once a replica's worker
is killed.
"""

from __future__ import annotations

import asyncio
import os
import signal

import openai
import pytest

import dcpgraph
from dcpgraph.checkpoints.model_dir import load_model, load_tokenizer
from dcpgraph.config import DcpgraphConfig
from dcpgraph.errors import ConfigError
from dcpgraph.models import build_model
from dcpgraph.serving.data_parallel import DataParallelEngine
from dcpgraph.testing.generation import hf_greedy
from dcpgraph.testing.prometheus import scrape
from dcpgraph.testing.server import running_server

PROMPTS = [[5, 9, 4, 77], [3, 4, 5], [11, 12, 13, 14, 15], [7], [21, 22], [8, 8, 8]]


def engines(count: int):
    return [dcpgraph.compile(build_model("llama"), block_size=4, num_blocks=32) for _ in range(count)]


def test_replicas_share_requests_and_keep_their_ids_apart():
    reference = engines(1)[0].generate(PROMPTS, 6)
    dp = DataParallelEngine(engines(2))
    assert dp.generate(PROMPTS, 6) == reference
    assert dp.requests_served == [3, 3]  # least outstanding first: alternating while all run
    first, second, third = (dp.add_request(p, 6) for p in PROMPTS[:3])
    assert (first, second, third) == (6, 7, 8) and [dp.live(0), dp.live(1)] == [2, 1]
    assert dp.abort(second) and not dp.abort(second) and [dp.live(0), dp.live(1)] == [2, 0]
    outputs = {first: [], third: []}
    while dp.live(0) or dp.live(1):
        for rid, token, _ in dp.step():
            outputs[rid].append(token)
    assert [outputs[first], outputs[third]] == [reference[0], reference[2]]
    assert dp.kv_usage_per_rank() == [(0, 32)] * 2 and dp.report()["data_parallel"]["live"] == [0, 0]
    with pytest.raises(ConfigError, match="runs one KV agent per replica"):
        dp.rank_call("kv.side", {})


def test_data_parallel_settings_are_checked():
    with pytest.raises(ConfigError, match=r"data_parallel_size=3 replicas do not split evenly over nnodes=2 \(each "
                                          r"node runs whole replicas\); use nnodes in \[1, 3\]"):
        DcpgraphConfig.from_fields(data_parallel_size=3, nnodes=2, tensor_parallel_size=2)
    # whole replicas a node: tp=3 need not split over the two nodes
    assert DcpgraphConfig.from_fields(data_parallel_size=2, nnodes=2, tensor_parallel_size=3).parallel.nnodes == 2
    with pytest.raises(ConfigError, match="use prefill_context_parallel_size=1"):
        DcpgraphConfig.from_fields(data_parallel_size=2, enable_expert_parallel=True, tensor_parallel_size=2,
                                   prefill_context_parallel_size=2)
    assert DcpgraphConfig.from_fields(data_parallel_size=2, enable_expert_parallel=True).parallel.enable_expert_parallel
    assert DcpgraphConfig.from_fields(data_parallel_size=2).parallel.data_parallel_size == 2


def test_replicas_are_placed_whole_on_nodes_with_their_own_ports():
    from dcpgraph.serving.nodes import NodeLayout

    head = NodeLayout(nnodes=2, node_rank=0, master_addr="10.0.0.1", master_port=4000)
    other = NodeLayout(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=4000)
    placed = head.replica_placements(4)
    assert [p.node for p in placed] == [0, 0, 1, 1]
    assert [list(p.local_ranks(2)) for p in placed] == [[0, 1], [0, 1], [], []]
    assert [list(p.local_ranks(2)) for p in other.replica_placements(4)] == [[], [], [0, 1], [0, 1]]
    assert [p.front_end_address("") for p in placed] == [("10.0.0.1", 4001 + d) for d in range(4)]
    assert head.expert_group_address("") == other.expert_group_address("") == ("10.0.0.1", 4000)
    one = NodeLayout().replica_placements(2)
    assert all(p.here for p in one) and one[1].front_end_address("127.0.0.1") == ("127.0.0.1", 0)


@pytest.mark.gloo
@pytest.mark.slow
def test_llm_with_two_replicas_equals_hf(checkpoints):
    path = checkpoints["qwen3"]
    hf = load_model(path, "float64")
    prompts = [[5 + i, 9, 4, 77] for i in range(4)]
    with dcpgraph.LLM(model=path, dtype="float64", block_size=4, tensor_parallel_size=2,
                      decode_context_parallel_size=2, data_parallel_size=2) as llm:
        assert llm.engine.generate(prompts, 8) == [hf_greedy(hf, p, 8) for p in prompts]
        report = llm.engine.report()
        assert report["data_parallel"]["requests_served"] == [2, 2] and len(llm.engine.worker_pids()) == 4
        assert llm.kv_usage_per_rank() == [0.0] * 4


@pytest.mark.gloo
@pytest.mark.slow
def test_serve_with_two_replicas_answers_concurrent_clients(checkpoints, tmp_path):
    path = checkpoints["qwen3"]
    hf, tokenizer = load_model(path, "float64"), load_tokenizer(path)
    prompts = ["The future of AI is", "héllo wörld", "x", "a b c d e f", "one two", "zz"]
    args = ("-dp", "2", "-tp", "2", "-dcp", "2", "--dtype", "float64", "--block-size", "4", "--max-model-len", "128")
    with running_server(path, *args, log_path=str(tmp_path / "serve.log")) as server:
        async def ask_all():
            api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
            return await asyncio.gather(*(api.completions.create(model=path, prompt=p, max_tokens=10, temperature=0)
                                          for p in prompts))

        answers = asyncio.run(ask_all())
        assert len(server.worker_pids()) == 4
        # each replica's share under its own engine label, summing to every request
        served = [sum(scrape(server, "vllm:request_success_total", engine=e)) for e in "01"]
        assert min(served) >= 1 and sum(served) == len(prompts)
        # a replica's worker dies: the server says so on /health and refuses new work, as with one replica
        os.kill(server.worker_pids()[-1], signal.SIGKILL)
        server.wait_down()
    for prompt, answer in zip(prompts, answers):
        expected = tokenizer.decode(hf_greedy(hf, tokenizer(prompt)["input_ids"], 10), skip_special_tokens=True)
        assert answer.choices[0].text == expected, prompt
