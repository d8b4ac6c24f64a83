"""DP attention + EP in serving: ``data_parallel_size=D`` with ``enable_expert_parallel``.

Default tier: the refusals made before any process starts (a model without routed experts,
experts that ``D·tp`` ranks do not divide, speculative decoding), and a lockstep
:class:`DataParallelEngine` that steps idle replicas and stops the group when one fails.
Slow tier, real gloo workers on a tiny Qwen3-MoE checkpoint (4 routed experts, top-2, saved with
transformers' defaults): ``LLM`` at tp=1·dp=2 and tp=2·dcp=2·dp=2 equals HF's greedy tokens with
both replicas serving, an idle replica runs dummy forwards, and a killed rank fails the whole
group promptly; ``dcpgraph serve -dp 2 --enable-expert-parallel`` answers ``openai`` clients.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from types import SimpleNamespace

import pytest

import dcpgraph
from dcpgraph.errors import ConfigError
from dcpgraph.serving.data_parallel import DataParallelEngine
from dcpgraph.serving.expert_replicas import check_expert_replicas, replica_configs, routed_experts
from dcpgraph.serving.workers import WorkerDiedError


def test_refusals_before_any_process_starts():
    moe = SimpleNamespace(num_experts=8)
    check_expert_replicas(moe, tp=2, replicas=2, speculative=False)
    with pytest.raises(ConfigError, match=r"8 routed experts cannot be partitioned over 6 ranks; valid "
                                          r"data_parallel_size: \[1, 2, 4\]"):
        check_expert_replicas(moe, tp=2, replicas=3, speculative=False)
    with pytest.raises(ConfigError, match="has no routed experts"):
        check_expert_replicas(SimpleNamespace(), tp=1, replicas=2, speculative=False)
    with pytest.raises(ConfigError, match="speculative decoding's draft forwards"):
        check_expert_replicas(moe, tp=1, replicas=2, speculative=True)
    with pytest.raises(ConfigError, match="built on gloo for host ranks only"):
        check_expert_replicas(moe, tp=1, replicas=2, speculative=False, device="cuda")
    nested = SimpleNamespace(text_config=SimpleNamespace(n_routed_experts=16))
    assert routed_experts(nested) == 16


def test_each_replica_gets_its_slice_and_the_shared_store():
    from dcpgraph.serving.engine_config import EngineConfig

    base = EngineConfig(model="m", dtype="float32", tensor_parallel_size=2,
                        engine_options={"enable_expert_parallel": True})
    configs = replica_configs(base, 2, "127.0.0.1", 4321)
    assert [c.engine_options["expert_replicas"] for c in configs] == [[2, 0], [2, 1]]
    assert [c.expert_group for c in configs] == [["127.0.0.1", 4321, 4, 0], ["127.0.0.1", 4321, 4, 1]]
    assert base.engine_options == {"enable_expert_parallel": True}  # the template is not changed


class FakeReplica:
    """A replica's step protocol: which steps it was asked to run, with or without work."""

    def __init__(self, fail_on_step: bool = False):
        self.asked, self.rid, self.fail_on_step, self.closed = 0, 0, fail_on_step, False
        self.pending: list[int] = []

    def add_request(self, prompt, max_new_tokens, **sampling):
        self.rid += 1
        self.pending.append(self.rid)
        return self.rid

    def begin_step(self):
        self.asked += 1

    def step_done(self):
        return not self.fail_on_step

    def healthy(self):
        return not self.fail_on_step

    def end_step(self):
        from dcpgraph.runtime.scheduler import StepEvent

        done, self.pending = self.pending, []
        return [StepEvent(r, 7, True, None, None) for r in done]

    def close(self):
        self.closed = True


def test_lockstep_steps_idle_replicas_and_stops_the_group_on_a_failure():
    replicas = [FakeReplica(), FakeReplica()]
    dp = DataParallelEngine(replicas, lockstep=True)
    dp.add_request([1, 2], 1)  # replica 0 only
    assert [event[0] for event in dp.step()] == [0]
    assert [r.asked for r in replicas] == [1, 1]  # the idle replica stepped too
    assert dp.step() == [] and [r.asked for r in replicas] == [1, 1]  # nobody busy: no step at all
    plain = [FakeReplica(), FakeReplica()]
    independent = DataParallelEngine(plain)
    independent.add_request([1], 1)
    independent.step()
    assert [r.asked for r in plain] == [1, 0]
    broken = [FakeReplica(), FakeReplica(fail_on_step=True)]
    dp = DataParallelEngine(broken, lockstep=True)
    dp.add_request([1], 1)
    with pytest.raises(WorkerDiedError, match="replica 1 failed during a lockstep step"):
        dp.step()
    assert all(r.closed for r in broken)


# -- real worker groups --------------------------------------------------------------------------
MAX_NEW = 6
PROMPTS = [[5, 9, 4, 77], [3, 4, 5, 6, 7, 8, 9], [11, 12]]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from dcpgraph.checkpoints.model_dir import load_model
    from dcpgraph.testing.checkpoints import save_tiny_checkpoint
    from dcpgraph.testing.generation import hf_greedy

    path = save_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")
    hf = load_model(path, "float64")
    return path, hf, [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


@pytest.mark.gloo
@pytest.mark.slow
@pytest.mark.parametrize(("tp", "dcp"), [(1, 1), (2, 2)])
def test_llm_replicas_sharing_experts_equal_hf(moe_checkpoint, tp, dcp):
    path, _, wanted = moe_checkpoint
    with dcpgraph.LLM(model=path, dtype="float64", block_size=4, tensor_parallel_size=tp,
                      decode_context_parallel_size=dcp, data_parallel_size=2, enable_expert_parallel=True,
                      worker_timeout_s=300) as llm:
        assert llm.engine.generate(PROMPTS, MAX_NEW) == wanted
        report = llm.engine.report()
        assert report["data_parallel"]["requests_served"] == [2, 1]
        # one request: replica 1 serves it (it holds the prompt's first block, so the prefix-aware router
        # sends it there), replica 0 runs a dummy forward for each of its steps
        before = [r["dummy_steps"] for r in report["replicas"]]
        assert llm.engine.generate(PROMPTS[1:2], MAX_NEW) == wanted[1:2]
        after = [r["dummy_steps"] for r in llm.engine.report()["replicas"]]
        assert after[1] == before[1] and after[0] - before[0] >= MAX_NEW
        assert len(llm.engine.worker_pids()) == 2 * tp
        if tp == 1:  # a rank that dies mid-run fails the whole group promptly, not at the gloo timeout
            os.kill(llm.engine.replicas[1].worker_pids()[0], signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(WorkerDiedError):
                llm.engine.generate(PROMPTS, MAX_NEW)
            assert time.monotonic() - start < 30
            assert not llm.engine.healthy()


@pytest.mark.gloo
@pytest.mark.slow
def test_serve_replicas_sharing_experts_answer_openai_clients(moe_checkpoint, tmp_path):
    import openai

    from dcpgraph.checkpoints.model_dir import load_tokenizer
    from dcpgraph.testing.generation import hf_greedy
    from dcpgraph.testing.prometheus import scrape
    from dcpgraph.testing.server import running_server

    path, hf, _ = moe_checkpoint
    tokenizer = load_tokenizer(path)
    prompts = ["The future of AI is", "x", "a b c d e f"]
    args = ("-dp", "2", "--enable-expert-parallel", "--dtype", "float64", "--block-size", "4",
            "--max-model-len", "128")
    with running_server(path, *args, log_path=str(tmp_path / "serve.log")) as server:
        async def ask_all():
            api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
            return await asyncio.gather(*(api.completions.create(model=path, prompt=p, max_tokens=8, temperature=0)
                                          for p in prompts))

        answers = asyncio.run(ask_all())
        served = [sum(scrape(server, "vllm:request_success_total", engine=e)) for e in "01"]
        assert min(served) >= 1 and sum(served) == len(prompts)
    for prompt, answer in zip(prompts, answers):
        expected = tokenizer.decode(hf_greedy(hf, tokenizer(prompt)["input_ids"], 8), skip_special_tokens=True)
        assert answer.choices[0].text == expected, prompt
