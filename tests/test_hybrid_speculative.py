"""Speculative decoding with hybrid targets is exact: one hybrid per recurrent kind (qwen3_next's
gated delta nets, lfm2's short convolutions, bamba's Mamba-2 mixers) gives HF ``generate``'s
greedy tokens with prompt-lookup drafts (some accepted, most rejected: the acceptance counters
show both) at tp=1, through 8-token prefill chunks (the verification rows share steps with prefill
chunks). Draft models, meshes and preemptions for every hybrid: tests/test_hybrid_acceptance.py.

The recurrent state is restored and the kept tokens replayed after a rejection
(:mod:`dcpgraph.runtime.state_rollback`): with the replay switched off the same run must give
other tokens, so these tests see a missing rollback. Refused by name: MTP with a hybrid target,
a draft model with recurrent layers of its own.
"""

from __future__ import annotations

import pytest
import torch
from hybrid_models import SPEC_MODELS, SPEC_NEW_TOKENS, SPEC_PROMPTS, llama_draft, ngram

import dcpgraph
from dcpgraph.errors import UnsupportedModelError
from dcpgraph.recurrent_state import refuse_recurrent_state_features
from dcpgraph.runtime import state_rollback
from dcpgraph.runtime.speculative_config import speculative_config
from dcpgraph.testing.generation import hf_greedy

SLOW = pytest.mark.slow  # HF's reference generate (torch fallbacks of its recurrent kernels) and a compile per run


@pytest.fixture(scope="module", params=[pytest.param(name, marks=() if name == "qwen3_next" else SLOW)
                                        for name in sorted(SPEC_MODELS)])
def case(request):
    """qwen3_next in the default tier; lfm2 and bamba in the slow one."""
    model = SPEC_MODELS[request.param]()
    refs = [hf_greedy(model, p, SPEC_NEW_TOKENS) for p in SPEC_PROMPTS]
    return request.param, model, dcpgraph.trace(model), refs


@pytest.fixture(scope="module")
def draft_program():
    return dcpgraph.trace(llama_draft())


def replays(engine) -> dict:
    return engine.speculative_report()["state_replays"]


def test_ngram_speculation_gives_hf_greedy_tokens(case):
    _, _, program, refs = case
    engine = dcpgraph.compile(program, block_size=4, max_num_batched_tokens=8, speculative_config=ngram())
    assert engine.generate(SPEC_PROMPTS, SPEC_NEW_TOKENS) == refs
    stats = engine.speculative_report()
    assert 0 < stats["accepted"] < stats["drafted"], stats  # drafts both kept and rejected
    assert replays(engine)["rows"] > 0  # rejected drafts were rolled back
    assert any(name.startswith("verify[") for name in engine.report()["graph_steps"])


@SLOW
def test_without_the_replay_the_tokens_differ(case, monkeypatch):
    """The rollback is what makes the tokens right: a run that restores nothing and replays
    nothing leaves each state past the rejected drafts and the bucket padding."""
    _, _, program, refs = case
    monkeypatch.setattr(state_rollback, "replay_chunks", lambda ran, kept, processed: [])
    engine = dcpgraph.compile(program, block_size=4, speculative_config=ngram())
    assert engine.generate(SPEC_PROMPTS, SPEC_NEW_TOKENS) != refs


@SLOW
def test_memory_report_counts_the_snapshot_rows(case, monkeypatch):
    """One snapshot row per slot: reported, allocated, and subtracted by memory-fraction sizing."""
    from dcpgraph import memory as mem

    _, _, program, _ = case
    plain = dcpgraph.compile(program, block_size=4, max_num_seqs=4).memory_report()
    engine = dcpgraph.compile(program, block_size=4, max_num_seqs=4, speculative_config=ngram())
    report = engine.memory_report()
    per_request = report["recurrent_state_bytes_per_request"]
    assert plain["recurrent_state_snapshot_slots"] == 0 and plain["recurrent_state_bytes_per_rank"] == [4 * per_request]
    assert report["recurrent_state_snapshot_slots"] == 4
    assert report["recurrent_state_bytes_per_rank"] == [8 * per_request]
    pools = {p.name for p in engine.program.recurrent_states}
    allocated = sum(t.numel() * t.element_size() for key, t in engine.executor.caches[0].items() if key in pools)
    assert allocated == 8 * per_request
    monkeypatch.setattr(mem, "device_memory", lambda device: mem.DeviceMemory(1 << 30, 1 << 30))
    sizing = mem.size_for_utilization(engine.program, 0.5, "cuda:0", ranks=1, max_num_batched_tokens=8,
                                      max_num_seqs=4, max_model_len=64)
    assert sizing.recurrent_state_bytes == 8 * per_request


def test_state_copies_read_every_source_before_writing():
    """``apply_state_copies`` copies whole rows of every pool, a swap included."""
    from dcpgraph.program import Lowering, RecurrentStateSpec

    class _Program:
        recurrent_states = (RecurrentStateSpec("conv_state_0", 0, "conv_state", (2, 3), torch.float32),)
        lowering = Lowering(state_slots=2, state_snapshots=2)

    pool = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 2, 3)
    caches = {"conv_state_0": pool.clone()}
    state_rollback.apply_state_copies(_Program, caches, torch.tensor([[0, 1], [1, 0], [0, 3]]))
    assert torch.equal(caches["conv_state_0"][0], pool[1]) and torch.equal(caches["conv_state_0"][1], pool[0])
    assert torch.equal(caches["conv_state_0"][3], pool[0]) and torch.equal(caches["conv_state_0"][2], pool[2])


def test_mtp_and_a_hybrid_draft_are_refused_by_name(case):
    name, _, program, _ = case
    with pytest.raises(UnsupportedModelError, match="method 'mtp' is not supported with recurrent layers"):
        refuse_recurrent_state_features([0, 2], speculative_config({"method": "mtp", "num_speculative_tokens": 1}))
    with pytest.raises(UnsupportedModelError, match="a draft model with recurrent layers"):
        dcpgraph.compile(program, block_size=4,
                         speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": program})


@pytest.mark.slow  # 1200 sampled requests through a hybrid target and a draft model
def test_sampled_tokens_keep_the_targets_distribution(draft_program):
    """Rejection sampling with a Llama draft over qwen3_next: the first three sampled tokens
    (top-k 3, temperature 1) fit the target's exact distribution from HF forwards (chi-square,
    the draft-model test's), with drafts both accepted and rejected."""
    from test_draft_model import SAMPLES, chi_square_p_value, exact_first_tokens, sampled_counts

    target = SPEC_MODELS["qwen3_next"]()
    engine = dcpgraph.compile(dcpgraph.trace(target), block_size=4, max_num_seqs=64, max_num_batched_tokens=512,
                              max_model_len=64, speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                                                    "model": draft_program})
    p = chi_square_p_value(sampled_counts(engine), exact_first_tokens(target), SAMPLES)
    stats = engine.speculative_report()
    assert 0 < stats["accepted"] < stats["drafted"], stats
    assert p > 1e-3, f"chi-square p-value {p:.2e}"


@pytest.mark.slow  # two gloo ranks tracing and compiling a hybrid on 2 shared cores
@pytest.mark.gloo
def test_ngram_speculation_on_gloo_ranks_gives_hf_greedy_tokens():
    """qwen3_next at tp2·dcp2 on two real gloo ranks, rank 0 driving: the state copies of each
    verification and replay step reach rank 1 with the step's other inputs."""
    from hybrid_models import NEW_TOKENS, PROMPTS, drive_on_gloo

    from dcpgraph.runtime.distributed import spawn

    results = spawn(drive_on_gloo, 2, "SPEC_MODELS", "qwen3_next", ngram(), timeout_s=400)
    model = SPEC_MODELS["qwen3_next"]()
    assert results[0]["tokens"] == [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    assert results[0]["spec_tokens"] == [hf_greedy(model, p, SPEC_NEW_TOKENS) for p in SPEC_PROMPTS]
    stats = results[0]["speculative"]
    assert 0 < stats["accepted"] < stats["drafted"] and stats["state_replays"]["rows"] > 0, stats
    assert results[0]["memory"]["recurrent_state_snapshot_slots"] == 4
