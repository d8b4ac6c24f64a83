"""Draft-model speculation: a second LM compiled on the same mesh proposes, the target verifies.

References: HF ``generate`` greedy on the target (tokens must be identical with any draft), and
for sampling the target's exact distribution over its first tokens computed with HF forwards
(the engine's speculative samples must fit it; an always-accept rule must not). A draft equal to
the target must have every draft accepted, which also proves the draft's KV cache stays in step
with the accepted tokens (rolled back on rejection, recomputed after preemption, shared blocks
under prefix caching).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import dcpgraph
from dcpgraph.models import build_model
from dcpgraph.runtime import rejection
from dcpgraph.testing.generation import hf_greedy, hf_reference

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [3], [40, 41, 42, 40, 41], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13]]
NEW = 14


def spec(model, k=3):
    return {"method": "draft_model", "num_speculative_tokens": k, "model": model}


@pytest.fixture(scope="module", params=["llama", "deepseek_v2"])
def setup(request):
    target = build_model(request.param, dtype=torch.float64)
    refs = [hf_greedy(target, p, NEW) for p in PROMPTS]
    program = dcpgraph.trace(target)
    other = dcpgraph.trace(build_model(request.param, seed=1, layers=1, dtype=torch.float64))
    return request.param, target, program, other, refs


def check_all_accepted(engine):
    stats = engine.report()["speculative"]
    assert stats["drafted"] > 0 and stats["accepted"] == stats["drafted"], stats
    assert stats["acceptance_rate"] == 1.0 and all(r == 1.0 for r in stats["acceptance_rate_per_position"] if r)


MESHES = [(1, 1, 1), (2, 2, 1), pytest.param(4, 2, 4, marks=pytest.mark.slow)]


@pytest.mark.parametrize("tp, dcp, interleave", MESHES)
def test_draft_equal_to_target_accepts_every_draft(setup, tp, dcp, interleave):
    _, _, program, _, refs = setup
    engine = dcpgraph.compile(program, tp=tp, dcp=dcp, interleave=interleave, block_size=4,
                              speculative_config=spec(program))
    assert engine.generate(PROMPTS, NEW) == refs
    check_all_accepted(engine)
    report = engine.report()
    assert any(name.startswith("verify[") for name in report["graph_steps"]), report["graph_steps"]
    assert engine.steps < NEW  # 1 + k tokens per verification step


def test_the_draft_has_its_own_smaller_kv_cache(setup):
    _, _, program, other, _ = setup
    engine = dcpgraph.compile(program, tp=2, dcp=2, block_size=4, speculative_config=spec(other))
    memory = engine.memory_report()
    assert len(memory["draft_kv_bytes_per_rank"]) == 2
    assert 0 < memory["draft_kv_bytes_per_rank"][0] < memory["kv_bytes_per_rank"][0]  # 1 layer against 2
    draft_caches = engine.runner.proposer.runner.executor.rank_caches(0)
    assert all(c.shape[0] == engine.blocks.num_blocks for c in draft_caches.values())


@pytest.mark.parametrize("tp, dcp, interleave", MESHES)
def test_a_different_draft_keeps_greedy_tokens(setup, tp, dcp, interleave):
    _, _, program, other, refs = setup
    engine = dcpgraph.compile(program, tp=tp, dcp=dcp, interleave=interleave, block_size=4,
                              speculative_config=spec(other))
    assert engine.generate(PROMPTS, NEW) == refs
    stats = engine.report()["speculative"]
    assert stats["drafted"] > 0 and stats["accepted"] < stats["drafted"]  # rejections happened and were rolled back


def test_mixed_with_prefill_chunks_prefix_hits_and_preemption(setup):
    """A small token budget puts prefill chunks beside verification rows; repeated prompts hit the
    prefix cache; a cache smaller than the requests preempts. Every draft is still accepted."""
    _, target, program, _, _ = setup
    long = [p * 2 for p in PROMPTS]
    refs = [hf_greedy(target, p, NEW) for p in long]
    cached = dcpgraph.compile(program, tp=2, dcp=2, block_size=4, max_num_batched_tokens=10, max_model_len=48,
                              enable_prefix_caching=True, speculative_config=spec(program))
    draft_runner, sizes = cached.runner.proposer.runner, []
    execute = draft_runner.execute
    draft_runner.execute = lambda chunks: sizes.append(sum(len(c.tokens) for c in chunks)) or execute(chunks)
    assert cached.generate(long, NEW) == refs
    assert cached.generate(long, NEW) == refs  # the second round hits the prefix cache
    assert max(sizes) <= 10  # the draft's catch-up (its prefill) is chunked by the same budget
    report = cached.report()
    assert report["prefix_cache"]["hit_tokens"] > 0
    assert report["graph_steps"].get("mixed", 0) > 2  # steps mixing prefill chunks and verification
    check_all_accepted(cached)
    small = dcpgraph.compile(program, tp=2, dcp=2, block_size=4, max_num_batched_tokens=10, num_blocks=7,
                             max_model_len=48, speculative_config=spec(program))
    assert small.generate(long, NEW) == refs
    assert small.report()["scheduler"]["preemptions"] > 0
    check_all_accepted(small)


def test_verification_buckets_change_no_token(setup):
    _, _, program, other, refs = setup
    on = dcpgraph.compile(program, block_size=4, capture_limit=4, speculative_config=spec(other, 2))
    off = dcpgraph.compile(program, block_size=4, capture_limit=0, speculative_config=spec(other, 2))
    assert on.generate(PROMPTS, NEW) == refs == off.generate(PROMPTS, NEW)
    assert on.report()["graph_steps"].get("verify[4x3]", 0) > 0  # 4 rows of 1 + 2 query tokens
    assert set(off.report()["graph_steps"]) == {"mixed"}
    assert "decode[4]" in on.report()["speculative"]["draft_graph_steps"]  # the draft's own decode buckets


def test_one_captured_verification_graph_serves_every_step(setup):
    """A user backend compiles each graph once; the verification graph is then replayed for steps
    of different lengths, tables and slots (all inputs, none baked in) with HF's tokens, and
    every call has the same static shapes."""
    _, _, program, other, refs = setup
    compiled, shapes = {}, {}

    def recording(gm, example_inputs):
        key = len(compiled)
        compiled[key] = tuple(tuple(t.shape) for t in example_inputs)

        def run(*args):
            shapes.setdefault(key, set()).add(tuple(tuple(t.shape) for t in args))
            return gm(*args)

        return run

    engine = dcpgraph.compile(program, backend=recording, block_size=4, capture_limit=4,
                              speculative_config=spec(other, 2))
    assert engine.generate(PROMPTS, NEW) == refs
    steps = engine.report()["graph_steps"]
    assert steps.get("verify[4x3]", 0) > 1
    inputs = engine.program.inputs  # the compiled target's (the draft's graphs have other inputs)
    ids_at = [s.target for s in inputs].index("input_ids")
    verify = [k for k, example in compiled.items() if len(example) == len(inputs) and example[ids_at] == (1, 4 * 3)]
    assert len(verify) == 1  # one graph for the (4, 1 + 2) bucket, compiled once
    assert len(shapes[verify[0]]) == 1  # every call had the same static shapes


# -- sampling: the distribution of the first tokens ------------------------------------------------
PROMPT, TOP_K, SAMPLES = [5, 6, 7], 3, 1200
PARAMS = dict(temperature=1.0, top_k=TOP_K)


def exact_first_tokens(model, length: int = 3) -> dict:
    """P(t1, t2, t3 | PROMPT) of top-k sampling at temperature 1, from HF forwards."""
    def next_probs(prefix):
        with torch.no_grad(), hf_reference(model):
            logits = model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].double()
        top = torch.topk(logits, TOP_K)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()))

    probs = {(): 1.0}
    for _ in range(length):
        probs = {seq + (t,): p * q for seq, p in probs.items() for t, q in next_probs(seq).items()}
    return probs


def chi_square_p_value(counts, probs, n):
    from test_rejection_sampling import chi_square_p_value as test

    return test(counts, probs, n)


def sampled_counts(engine) -> dict:
    outs = engine.generate([PROMPT] * SAMPLES, 4, seed=0, **PARAMS)
    counts: dict = {}
    for out in outs:
        counts[tuple(out[:3])] = counts.get(tuple(out[:3]), 0) + 1
    return counts


@pytest.fixture(scope="module")
def llama_sampling():
    target = build_model("llama", dtype=torch.float64)
    program = dcpgraph.trace(target)
    draft = dcpgraph.trace(build_model("llama", seed=1, layers=1, dtype=torch.float64))
    engine = dcpgraph.compile(program, block_size=4, max_num_seqs=64, max_num_batched_tokens=512,
                              speculative_config=spec(draft, 2))
    return engine, exact_first_tokens(target)


@pytest.mark.slow
def test_sampled_tokens_have_the_targets_distribution(llama_sampling):
    engine, exact = llama_sampling
    p = chi_square_p_value(sampled_counts(engine), exact, SAMPLES)
    stats = engine.report()["speculative"]
    assert stats["drafted"] > 0 and 0 < stats["accepted"] < stats["drafted"]
    assert p > 1e-3, f"chi-square p-value {p:.2e}"


@pytest.mark.slow
def test_an_always_accept_rule_fails_the_engine_test(llama_sampling, monkeypatch):
    engine, exact = llama_sampling
    monkeypatch.setattr(rejection, "acceptance_probability", lambda p, q: 1.0)
    assert chi_square_p_value(sampled_counts(engine), exact, SAMPLES) < 1e-6


def test_seeded_sampling_reproduces(setup):
    _, _, program, other, _ = setup
    engine = dcpgraph.compile(program, tp=2, dcp=2, block_size=4, speculative_config=spec(other))
    first = engine.generate(PROMPTS, 8, temperature=0.9, seed=3)
    assert engine.generate(PROMPTS, 8, temperature=0.9, seed=3) == first
    assert engine.report()["speculative"]["drafted"] > 0
    assert all(len(t) == 8 for t in first)
    assert list(itertools.chain(*first))  # something was sampled
