"""P/D between instances whose replicas share the routed experts (``-dp D --enable-expert-parallel``).

Default tier: lockstep producer and consumer clients with real KV agents (real ``TCPStore``s,
replicas faked: no model runs) that log every call each replica gets. Holding, serving and
receiving transfers between steps never puts a rank op inside a step, every step starts on every
replica (one holding only transfers included), so every replica steps the same number of times
(the same EP collectives in the same order), and an adopted request's tokens come out of its
replica's steps under the client's id.
Slow tier, on real gloo workers: a tiny Qwen3-MoE at ``-dp 2 -tp 1 --enable-expert-parallel`` as
both producer and consumer behind ``dcpgraph proxy`` answers concurrent ``openai`` clients with
HF's greedy text, every replica of both sides serving with as many forwards as the other
(``dcpgraph:model_forwards_total``; a request sent alone makes the other replica of each side run
dummy forwards), nothing recomputed on the consumer.
"""

from __future__ import annotations

import asyncio

import pytest

from dcpgraph.runtime.scheduler import StepEvent
from dcpgraph.serving.data_parallel import DataParallelEngine
from dcpgraph.serving.kv_connector import KVTransferConfig
from dcpgraph.serving.kv_connector.plan import KVSide
from dcpgraph.serving.kv_connector.replicas import ReplicaKVAgents
from dcpgraph.testing.pd import consecutive_free_ports

SIDE = KVSide(1, 1, 1, 4, "gqa", 1, (("k", "key", 1, 8, "torch.float64"), ("v", "value", 1, 8, "torch.float64")))


class Group:
    """What the replicas of one lockstep group share: the log of calls in order, and which
    replicas are inside a step now."""

    def __init__(self):
        self.log: list[tuple] = []
        self.stepping: set[int] = set()


class LoggedReplica:
    """A replica's engine with the rank ops of a transfer: each request emits token ``7`` per
    step until its ``max_new_tokens``; ``kv.hold`` takes a request out of its steps, ``kv.adopt``
    puts one in. A rank op made while any replica of the group is inside a step fails the test."""

    def __init__(self, group: Group, index: int):
        self.group, self.index = group, index
        self.running: dict[int, list[int]] = {}  # local id -> [prompt..., tokens emitted so far]
        self.left: dict[int, int] = {}  # local id -> tokens still to emit
        self.next_id = 0

    def _new(self, prompt, tokens_left: int, output=()) -> int:
        rid, self.next_id = self.next_id, self.next_id + 1
        self.running[rid], self.left[rid] = list(prompt) + list(output), tokens_left
        return rid

    def add_request(self, prompt, max_new_tokens, **sampling):
        return self._new(prompt, max_new_tokens)

    def begin_step(self):
        self.group.log.append(("begin", self.index))
        self.group.stepping.add(self.index)

    def step_done(self):
        return True

    def healthy(self):
        return True

    def end_step(self):
        self.group.stepping.discard(self.index)
        self.group.log.append(("end", self.index))
        events = []
        for rid in sorted(self.running):
            self.running[rid].append(7)
            self.left[rid] -= 1
            events.append(StepEvent(rid, 7, self.left[rid] == 0, None, None))
            if self.left[rid] == 0:
                del self.running[rid], self.left[rid]
        return events

    def abort(self, rid):
        return self.running.pop(rid, None) is not None and self.left.pop(rid) is not None

    def rank_call(self, name, args):
        assert not self.group.stepping, f"rank op {name} on replica {self.index} while {self.group.stepping} step"
        self.group.log.append(("op", self.index, name))
        if name == "kv.side":
            return [SIDE.to_json()]
        if name == "kv.hold":
            tokens = self.running.pop(args["rid"])
            del self.left[args["rid"]]
            return [{"tokens": tokens, "computed": len(tokens) - 1, "prompt_len": len(tokens) - 1}]
        if name == "kv.release":
            return [True]
        if name == "kv.adopt":
            rid = self._new(args["prompt"], args["max_new_tokens"] - len(args["output"]), args["output"])
            return [{"rid": rid, "start": 0}]
        if name in ("kv.send", "kv.recv"):
            return [8 * (args["end"] - args["start"])]
        raise AssertionError(f"unexpected rank op {name}")


def steps_of(group: Group, replicas: int) -> list[int]:
    """How many steps each replica ran; asserts every step began on all replicas before any ended
    and that no rank op came between a step's first begin and its last end."""
    counts, open_step = [0] * replicas, []
    for entry in group.log:
        if entry[0] == "begin":
            assert len(open_step) < replicas and entry[1] not in open_step, group.log
            open_step.append(entry[1])
        elif entry[0] == "end":
            assert sorted(open_step) == list(range(replicas)), f"a step did not begin on every replica: {group.log}"
            counts[entry[1]] += 1
            if sum(counts) % replicas == 0:
                open_step = []
        else:
            assert not open_step, f"{entry} inside a step: {group.log}"
    return counts


def test_transfers_between_lockstep_steps_keep_every_replica_in_step():
    port = consecutive_free_ports(2)
    made, taken = Group(), Group()
    producer = DataParallelEngine([LoggedReplica(made, 0), LoggedReplica(made, 1)], lockstep=True)
    consumer = DataParallelEngine([LoggedReplica(taken, 0), LoggedReplica(taken, 1)], lockstep=True)
    senders = ReplicaKVAgents(KVTransferConfig("kv_producer", 0, kv_port=port), producer)
    takers = ReplicaKVAgents(KVTransferConfig("kv_consumer", 1, kv_port=port), consumer)
    try:
        # producer: two prefills (one per replica) reach their first token and are held, as the
        # engine loop holds them; a third request keeps stepping both replicas, replica 1 holding
        # only its transfer (it runs a dummy forward there)
        first, second = producer.add_request([1, 2, 3], 2), producer.add_request([4, 5], 2)
        assert {e[0] for e in producer.step()} == {first, second}
        params = [senders.hold(first), senders.hold(second)]
        assert [p["kv_replica"] for p in params] == [0, 1]
        third = producer.add_request([6], 3)
        assert producer.engine_of(third) == 0
        # consumer: a request of its own on replica 0, the transfers adopted where the router says
        own = consumer.add_request([9, 9], 4)
        adopted = [takers.receive(p["prompt_token_ids"], 4, {}, p)[0] for p in params]
        assert [consumer.engine_of(r) for r in (own, *adopted)] == [0, 1, 0]  # least outstanding, then index
        events: dict[int, list[int]] = {}
        for _ in range(4):  # the engine loop: ticks (serving the asks) between steps
            senders.tick()
            if producer.live(0) or producer.live(1):
                producer.step()
            for rid, token, _ in consumer.step():
                events.setdefault(rid, []).append(token)
        assert events == {own: [7] * 4, adopted[0]: [7] * 3, adopted[1]: [7] * 3}  # joined the batch
        assert not senders.held and senders.stats["transfers_sent"] == 2 == takers.stats["transfers_received"]
        produced, consumed = steps_of(made, 2), steps_of(taken, 2)
        assert produced == [4, 4] and consumed == [4, 4]  # every replica: the same forwards, in order
        assert ("op", 1, "kv.send") in made.log and ("op", 1, "kv.recv") in taken.log
    finally:
        senders.close()
        takers.close()


# -- real worker groups --------------------------------------------------------------------------
@pytest.mark.gloo
@pytest.mark.slow  # four tp=1 workers in two EP groups, two front ends, a proxy: 266 s at load 8.5 on 2 cores (start-up)
def test_pd_between_replicas_sharing_experts_equals_hf(tmp_path):
    import openai

    from dcpgraph.checkpoints.model_dir import load_model, load_tokenizer
    from dcpgraph.testing.checkpoints import save_tiny_checkpoint
    from dcpgraph.testing.generation import hf_greedy
    from dcpgraph.testing.pd import kv_stats, running_replica_pd, wait_kv_free
    from dcpgraph.testing.prometheus import scrape

    path = save_tiny_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe")
    hf, tokenizer = load_model(path, "float64"), load_tokenizer(path)
    prompts = ["The future of AI is", "héllo wörld", "a b c d e f g h", "one two three", "zz top", "x y"]
    with running_replica_pd(path, ("-dp", "2", "--enable-expert-parallel"), tmp_path) as (p, d, proxy):
        async def ask_all():
            api = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=120)
            together = await asyncio.gather(*(api.completions.create(model="tiny", prompt=q, max_tokens=8,
                                                                     temperature=0) for q in prompts[:-1]))
            # the last one alone: one replica of each side works, the other runs dummy forwards
            return [*together, await api.completions.create(model="tiny", prompt=prompts[-1], max_tokens=8,
                                                            temperature=0)]

        answers = asyncio.run(asyncio.wait_for(ask_all(), 240))
        wait_kv_free(p, d)
        for server in (p, d):  # every replica of both sides served, under its own engine label
            served = [sum(scrape(server, "vllm:request_success_total", engine=e)) for e in "01"]
            assert min(served) >= 1 and sum(served) == len(prompts), (server.url, served)
            # lockstep: each replica ran as many forwards (its batches, and dummies when idle) as the other
            forwards = [[scrape(server, "dcpgraph:model_forwards_total", engine=e, kind=k)[0] for k in ("work", "dummy")]
                        for e in "01"]
            assert sum(forwards[0]) == sum(forwards[1]) and min(w for w, _ in forwards) >= 1, (server.url, forwards)
            assert max(dummy for _, dummy in forwards) >= 1, (server.url, forwards)
        sent, received = kv_stats(p), kv_stats(d)
        assert [s["transfers_sent"] >= 1 for s in sent["replicas"]] == [True, True]
        assert received["transfers_received"] == sent["transfers_sent"] == len(prompts)
        assert received["failures"] == sent["failures"] == 0
        assert received["prompt_tokens_computed"] == 0  # every prompt token came by transfer or prefix cache
        assert received["tokens_received"] == sent["tokens_sent"] > 0
    for prompt, answer in zip(prompts, answers):
        want = tokenizer.decode(hf_greedy(hf, tokenizer(prompt)["input_ids"], 8), skip_special_tokens=True)
        assert answer.choices[0].text == want, prompt
