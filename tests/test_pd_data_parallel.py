"""P/D with data-parallel replicas (``-dp D`` with ``--kv-transfer-config``).

Default tier: replica ``r``'s rendezvous is ``kv_port + r`` and a producer's parameters name the
replica holding the KV, so a consumer asks at that replica's store and only that replica's agent
sees the ask (real ``TCPStore``s, replicas faked: no model runs); a consumer adopts on the replica
its router picks; settings P/D cannot run with replicas are refused by name, by ``dcpgraph serve``
before it reads the model (replicas sharing the experts are not among them); the agent's counters
are the ones summed over replicas. Slow tier, on real
gloo workers: a ``-dp 2`` producer and a ``-dp 2`` consumer behind ``dcpgraph proxy`` answer
concurrent ``openai`` clients with HF's greedy text, every replica on both sides serving.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from dcpgraph.errors import ConfigError, RequestError
from dcpgraph.serving.data_parallel import DataParallelEngine
from dcpgraph.serving.kv_connector import KVTransferConfig
from dcpgraph.serving.kv_connector.agent import COUNTERS
from dcpgraph.serving.kv_connector.replicas import ReplicaKVAgents, check_data_parallel_pd
from dcpgraph.testing.pd import consecutive_free_ports


class FakeReplica:
    """A replica's engine as the KV agent and the data-parallel client see it: requests get local
    ids; ``kv.hold`` answers a prefilled request's tokens."""

    def __init__(self):
        self.prompts: dict[int, list[int]] = {}
        self.held: list[int] = []

    def add_request(self, prompt, max_new_tokens, **sampling):
        self.prompts[len(self.prompts)] = list(prompt)
        return len(self.prompts) - 1

    def rank_call(self, name, args):
        if name == "kv.side":
            return [{"fake": True}]
        if name == "kv.hold":
            self.held.append(args["rid"])
            prompt = self.prompts[args["rid"]]
            return [{"tokens": prompt + [99], "computed": len(prompt), "prompt_len": len(prompt)}]
        if name == "kv.release":
            return [True]
        raise AssertionError(f"unexpected rank op {name}")


def test_replica_endpoints_are_the_configured_port_plus_the_replica():
    config = KVTransferConfig("kv_consumer", kv_rank=1, kv_port=14579)
    assert [config.for_replica(r).kv_port for r in range(3)] == [14579, 14580, 14581]
    assert config.endpoint_of({"kv_replica": 2}).kv_port == 14581
    assert config.endpoint_of({}).kv_port == 14579  # a producer without replicas
    with pytest.raises(ConfigError, match="kv_replica must be a replica index"):
        config.endpoint_of({"kv_replica": "1"})
    with pytest.raises(ConfigError, match=r"must be in \[kv_port, 65535\]"):
        KVTransferConfig("kv_consumer", kv_port=65535).for_replica(1)


def test_settings_data_parallel_pd_cannot_run_are_refused_by_name():
    producer, consumer = KVTransferConfig("kv_producer", 0), KVTransferConfig("kv_consumer", 1)
    for config in (producer, consumer, KVTransferConfig("kv_both", 0)):
        check_data_parallel_pd(config, 4)  # runs, with or without --enable-expert-parallel
    check_data_parallel_pd(KVTransferConfig("kv_producer", 1), 1)  # no replicas: as before
    with pytest.raises(ConfigError, match="a kv_producer with --data-parallel-size 2 must be kv_rank 0, got kv_rank 1"):
        check_data_parallel_pd(KVTransferConfig("kv_producer", 1), 2)
    with pytest.raises(ConfigError, match="a kv_both with --data-parallel-size 2 must be kv_rank 0"):
        check_data_parallel_pd(KVTransferConfig("kv_both", 1), 2)
    with pytest.raises(ConfigError, match="replica 3 has no rendezvous port"):
        check_data_parallel_pd(KVTransferConfig("kv_consumer", 1, kv_port=65533), 4)


def test_serve_refuses_them_before_reading_the_model(tmp_path, capsys):
    from dcpgraph.serving.cli import main

    empty = tmp_path / "m"  # no checkpoint: the refusal comes before anything reads it
    empty.mkdir()
    config = '{"kv_role": "kv_producer", "kv_rank": 1}'
    assert main([str(empty), "-dp", "2", "--kv-transfer-config", config]) == 2
    assert "must be kv_rank 0, got kv_rank 1" in capsys.readouterr().err
    # replicas sharing the experts (DP attention + EP) are P/D instances like any others: a valid
    # consumer gets past every P/D check to the model (none here), an invalid producer gets the same refusal
    assert main([str(empty), "-dp", "2", "--enable-expert-parallel", "--kv-transfer-config",
                 '{"kv_role": "kv_consumer", "kv_rank": 1}']) == 2
    assert "must be a local HF model directory" in capsys.readouterr().err
    assert main([str(empty), "-dp", "2", "--enable-expert-parallel", "--kv-transfer-config", config]) == 2
    assert "must be kv_rank 0, got kv_rank 1" in capsys.readouterr().err


def test_a_transfer_is_asked_for_at_the_replica_that_holds_it():
    """A producer at -dp 2 hosting both stores: each request is held by the replica that ran it,
    leaves the client, and a consumer's ask (at the endpoint the parameters name) reaches only
    that replica's agent."""
    port = consecutive_free_ports(2)
    config = KVTransferConfig("kv_producer", 0, kv_port=port)
    replicas = [FakeReplica(), FakeReplica()]
    dp = DataParallelEngine(replicas)
    agents = ReplicaKVAgents(config, dp)
    try:
        assert [a.config.kv_port for a in agents.agents] == [port, port + 1]
        first, second = dp.add_request([1, 2, 3], 2), dp.add_request([4, 5], 2)
        assert [dp.engine_of(first), dp.engine_of(second)] == [0, 1]
        params = [agents.hold(first), agents.hold(second)]
        assert [p["kv_replica"] for p in params] == [0, 1] and [r.held for r in replicas] == [[0], [0]]
        assert params[1]["prompt_token_ids"] == [4, 5] and params[1]["output_token_ids"] == [99]
        assert [dp.live(0), dp.live(1)] == [0, 0] and agents.held  # left the client, still held
        consumer = KVTransferConfig("kv_consumer", 1, kv_port=port)
        consumer.endpoint_of(params[1]).connector().request_kv(params[1]["transfer_id"], {"start": 0})
        wanted = params[1]["transfer_id"]
        assert agents.agents[1].connector.poll_requests([wanted]) == {wanted: {"start": 0}}
        assert agents.agents[0].connector.poll_requests([wanted]) == {}  # another store
        stats = agents.stats
        assert stats["held"] == 2 and [s["kv_port"] for s in stats["replicas"]] == [port, port + 1]
    finally:
        agents.close()
    assert not agents.held


def test_a_consumer_adopts_on_the_routed_replica():
    class Received:
        def __init__(self, config, engine, *, replica):
            self.replica, self.held, self.calls = replica, {}, []

        def receive(self, prompt_ids, max_tokens, sampling, params):
            self.calls.append(params["transfer_id"])
            if params["transfer_id"] == "bad":
                raise RequestError("refused")
            return 40 + len(self.calls), [7]

        def close(self):
            pass

    dp = DataParallelEngine([FakeReplica(), FakeReplica()])
    agents = ReplicaKVAgents(KVTransferConfig("kv_consumer", 1), dp, agent=Received)
    busy = dp.add_request([9, 9], 4)  # replica 0 has a live request: the next goes to replica 1
    rid, output = agents.receive([1, 2, 3], 8, {}, {"transfer_id": "t"})
    assert output == [7] and dp.engine_of(rid) == 1 and dp.engine_of(busy) == 0
    assert [a.calls for a in agents.agents] == [[], ["t"]]
    with pytest.raises(RequestError, match="refused"):
        agents.receive([5], 8, {}, {"transfer_id": "bad"})
    assert [dp.live(0), dp.live(1)] == [1, 1]  # a failed receive joins nothing


IDENTITY = ("kv_rank", "kv_replica", "kv_port")  # which agent it is, not something it counted


def test_every_count_an_agent_keeps_is_summed_over_replicas():
    """The summed counters are the agent's own (one definition): a count added to the agent's
    stats outside ``COUNTERS`` would be missing from an instance's totals, and this fails."""
    dp = DataParallelEngine([FakeReplica(), FakeReplica(), FakeReplica()])
    agents = ReplicaKVAgents(KVTransferConfig("kv_consumer", 1), dp)  # no store hosted: no ports
    try:
        counts = sorted(k for k, v in agents.agents[0].stats.items() if type(v) is int and k not in IDENTITY)
        assert counts == sorted(COUNTERS)
        for r, agent in enumerate(agents.agents):
            for i, key in enumerate(COUNTERS):
                agent.stats[key] = (r + 1) * 10 + i
        stats = agents.stats
        assert {k: stats[k] for k in COUNTERS} == {k: 60 + 3 * i for i, k in enumerate(COUNTERS)}
        assert [s["kv_replica"] for s in stats["replicas"]] == [0, 1, 2]
    finally:
        agents.close()


@pytest.mark.gloo
@pytest.mark.slow  # four tp=1 worker processes, two front ends and a proxy: ~35 s on a loaded core
def test_pd_with_two_replicas_on_each_side_equals_hf(checkpoints, tmp_path):
    from dcpgraph.checkpoints.model_dir import load_model, load_tokenizer
    from dcpgraph.testing.generation import hf_greedy
    from dcpgraph.testing.pd import kv_stats, running_replica_pd, wait_kv_free
    from dcpgraph.testing.prometheus import scrape

    path = checkpoints["qwen3"]
    hf, tokenizer = load_model(path, "float64"), load_tokenizer(path)
    prompts = ["The future of AI is", "héllo wörld", "a b c d e f g h", "one two three", "zz top", "x y"]
    with running_replica_pd(path, ("-dp", "2"), tmp_path) as (p, d, proxy):
        async def ask_all():
            api = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=120)
            return await asyncio.gather(*(api.completions.create(model="tiny", prompt=q, max_tokens=8, temperature=0)
                                          for q in prompts))

        answers = asyncio.run(asyncio.wait_for(ask_all(), 240))
        wait_kv_free(p, d)
        for server in (p, d):  # every replica of both sides served, under its own engine label
            served = [sum(scrape(server, "vllm:request_success_total", engine=e)) for e in "01"]
            assert min(served) >= 1 and sum(served) == len(prompts), (server.url, served)
        producer, consumer = kv_stats(p), kv_stats(d)
        assert [s["transfers_sent"] >= 1 for s in producer["replicas"]] == [True, True]
        assert consumer["transfers_received"] == producer["transfers_sent"] >= 1 and consumer["failures"] == 0
        assert consumer["prompt_tokens_computed"] == 0
    for prompt, answer in zip(prompts, answers):
        want = tokenizer.decode(hf_greedy(hf, tokenizer(prompt)["input_ids"], 8), skip_special_tokens=True)
        assert answer.choices[0].text == want, prompt
