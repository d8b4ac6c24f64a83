"""End to end, hybrid models through ``dcpgraph.compile`` and the engine at tp=1·dcp=1: qwen3_next
(three gated delta net layers, one gated attention layer) and lfm2 (short convolutions around an
attention layer) give HF's greedy tokens (``generate``, do_sample=False) for a batch whose longest
prompt is longer than the prefill chunk (8 tokens), with a KV cache small enough to preempt (the
preempted request restarts its recurrent state from a fresh slot). The scheduler's state slots:
one per running request, given back at finish, abort and preemption (speculative decoding:
tests/test_hybrid_speculative.py; prefix caching: tests/test_hybrid_acceptance.py). (Meshes with TP and DCP:
tests/test_hybrid_mesh.py.) (The distributed
executor's refusal needs an initialised torch.distributed world, which these tests do not start.)"""

import pytest
import torch

import dcpgraph
from dcpgraph.recurrent_state import GatedDeltaNetShape, ShortConvShape
from dcpgraph.testing.generation import drain

transformers = pytest.importorskip("transformers")

from hybrid_models import MODELS, PROMPTS, run_through_preemption  # noqa: E402 - after the transformers check

# Per request, by the layouts' formulas: 3 GDN layers (Hk 2, Hv 4, Dk = Dv = 8, K 4), fp32 model;
# 2 short convolutions (C 32, K 3).
EXPECTED_STATE_BYTES = {
    "Qwen3NextForCausalLM": 3 * GatedDeltaNetShape(2, 4, 8, 8, 4).state_bytes_per_request(torch.float32),
    "Lfm2ForCausalLM": 2 * ShortConvShape(32, 3).state_bytes_per_request(torch.float32),
}


@pytest.fixture(scope="module", params=[pytest.param("qwen3_next"), pytest.param("lfm2", marks=pytest.mark.slow)])
def case(request):
    model = MODELS[request.param]()
    return model, dcpgraph.trace(model)


@pytest.mark.slow  # ~40 s a model on 2 shared cores (verified compile, HF generate, 20 steps)
def test_hybrid_gives_hf_greedy_tokens_through_chunks_and_preemption(case):
    engine = run_through_preemption(*case)
    assert any(name.startswith("decode[") for name in engine.runner.graph_steps)  # padded decode rows too


@pytest.mark.slow  # ~25 s: a verified compile and a few steps
def test_state_slots_follow_running_requests(case):
    _, program = case
    engine = dcpgraph.compile(program, block_size=4, max_num_batched_tokens=32, max_num_seqs=2)
    scheduler = engine.scheduler
    assert scheduler.state_slots.count == 2
    report = engine.memory_report()
    pools = engine.program.recurrent_states
    allocated = sum(t.numel() * t.element_size() for name, t in engine.executor.caches[0].items()
                    if name in {p.name for p in pools})
    assert report["recurrent_state_bytes_per_rank"] == [allocated] == [2 * report["recurrent_state_bytes_per_request"]]
    assert report["recurrent_state_bytes_per_request"] == EXPECTED_STATE_BYTES[program.facts.architecture]
    a = engine.add_request(PROMPTS[0], max_new_tokens=2)
    b = engine.add_request(PROMPTS[1], max_new_tokens=2)
    c = engine.add_request(PROMPTS[2], max_new_tokens=2)
    engine.step()
    running = {r.id: r.state_slot for r in scheduler.running}
    assert sorted(running.values()) == [0, 1] and scheduler.get(c).state_slot is None  # c waits: no slot
    engine.abort(a)
    assert scheduler.state_slots.free == [running[a]]
    drain(engine)
    assert sorted(scheduler.state_slots.free) == [0, 1] and scheduler.get(b) is None
    adopted = _request()  # a transferred request (P/D) takes a state slot at adoption, gives it back at its end
    scheduler.adopt(adopted, ())
    assert adopted.state_slot in (0, 1) and len(scheduler.state_slots.free) == 1
    scheduler.abort(adopted.id)
    assert sorted(scheduler.state_slots.free) == [0, 1]


def _request():
    from dcpgraph.runtime.sampling_params import SamplingParams
    from dcpgraph.runtime.scheduler import Request
    return Request(99, [1, 2], 2, SamplingParams())


