"""MTP speculation (``method="mtp"``) for a tiny DeepSeek-V3 checkpoint with an MTP layer.

References: the same engine without speculation (greedy tokens must be identical), and an eager
loop of :class:`~dcpgraph.speculative.mtp_module.MTPModule` (PyTorch SDPA over the whole
sequence, no paged cache, no DCP) fed the HF target's final hidden states: every draft the
compiled proposer makes must equal that loop's argmax, which checks the hidden-state output,
the MTP program, its KV cache kept in step with accepted tokens, and the chaining of drafts.
"""

from __future__ import annotations

import pytest
import torch
from mtp_reference import eager_drafts, record_drafts

import dcpgraph
from dcpgraph.checkpoints.loader import load_program
from dcpgraph.errors import ConfigError
from dcpgraph.testing.checkpoints import make_mtp_predictable, save_tiny_checkpoint
from dcpgraph.testing.generation import hf_reference

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [3], [40, 41, 42, 40, 41], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13]]
NEW = 10
LONG = 24  # the eager-reference test: enough drafting steps to see accepted drafts at every position
K = 2


def spec(k=K):
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint whose MTP drafts are sometimes accepted (:func:`~dcpgraph.testing.checkpoints.make_mtp_predictable`: the target
    nearly a bigram model, the MTP layer close to it but reading its hidden-state input and its own
    KV cache strongly enough that MTP KV written from the wrong state changes drafts)."""
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("v3mtp"), "deepseek_v3", dtype=torch.float64,
                                mtp_weights=True)
    make_mtp_predictable(path, 0.01, hidden_part=0.3, mtp_attention=0.3)
    program = load_program(path, "float64")
    plain = dcpgraph.compile(program, block_size=4).generate(PROMPTS, LONG)
    return path, program, plain


@pytest.mark.parametrize("tp, dcp", [(1, 1), (2, 2), (4, 2)])
def test_mtp_drafts_equal_an_eager_loop_and_greedy_tokens_are_unchanged(checkpoint, tp, dcp):
    import transformers as tf

    from dcpgraph.speculative.mtp_module import eager_mtp_module

    path, program, plain = checkpoint
    engine = dcpgraph.compile(program, tp=tp, dcp=dcp, block_size=4, max_num_batched_tokens=8,
                              speculative_config=spec())
    seen = record_drafts(engine)
    assert engine.generate(PROMPTS, LONG) == plain
    stats = engine.report()["speculative"]
    assert any(n.startswith("verify[") for n in engine.report()["graph_steps"])
    assert any(n.startswith("decode[") for n in engine.runner.proposer.graph_steps)  # MTP steps in buckets
    assert 0 < stats["accepted_per_position"][1] and stats["accepted"] < stats["drafted"], stats
    target = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    mtp = eager_mtp_module(path, torch.float64)
    assert len(seen) >= 40
    for tokens, s, drafts in seen:
        assert drafts == eager_drafts(target, mtp, tokens, s, len(drafts)), (tokens[: s + 1], drafts)


def test_mtp_drafts_stay_exact_with_prefill_chunks_prefix_hits_and_preemption(checkpoint):
    """A small token budget puts prefill chunks beside verification rows (and splits the MTP's
    catch-up); repeated prompts hit the prefix cache (those requests' cached positions have no
    target hidden states, so they get no MTP drafts: tokens stay exact); a cache smaller than the
    requests preempts (the MTP restarts from position 0 with the recomputed hidden states).
    Tokens equal the non-speculative engine's and every draft equals the eager loop's."""
    import transformers as tf

    from dcpgraph.speculative.mtp_module import eager_mtp_module

    path, program, _ = checkpoint
    long = [p * 2 for p in PROMPTS]
    plain = dcpgraph.compile(program, block_size=4, max_model_len=48).generate(long, NEW)
    options = dict(tp=2, dcp=2, block_size=4, max_num_batched_tokens=10, max_model_len=48, speculative_config=spec())
    cached = dcpgraph.compile(program, enable_prefix_caching=True, **options)
    seen, sizes = record_drafts(cached), []
    run = cached.runner.proposer._run
    cached.runner.proposer._run = lambda chunks, hidden: sizes.append(sum(len(c.tokens) for c in chunks)) or run(
        chunks, hidden)
    assert cached.generate(long, NEW) == plain
    assert max(sizes) == 10  # the MTP's catch-up over a long prompt is split by the token budget
    assert cached.generate(long, NEW) == plain  # the second round hits the prefix cache
    assert cached.report()["prefix_cache"]["hit_tokens"] > 0
    assert cached.report()["graph_steps"].get("mixed", 0) > 2  # prefill chunks beside verification
    small = dcpgraph.compile(program, num_blocks=7, **options)
    seen += record_drafts(small)
    assert small.generate(long, NEW) == plain
    assert small.report()["scheduler"]["preemptions"] > 0 and small.report()["speculative"]["drafted"] > 0
    target = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    mtp = eager_mtp_module(path, torch.float64)
    for tokens, s, drafts in seen:
        assert drafts == eager_drafts(target, mtp, tokens, s, len(drafts)), (tokens[: s + 1], drafts)


@pytest.mark.parametrize("tp, dcp", [(1, 1), (2, 2)])
def test_mtp_that_predicts_the_target_accepts_every_draft(tmp_path, tp, dcp):
    path = save_tiny_checkpoint(tmp_path / "v3", "deepseek_v3", dtype=torch.float64, mtp_weights=True)
    make_mtp_predictable(path, 0.0)
    program = load_program(path, "float64")
    plain = dcpgraph.compile(program, block_size=4).generate(PROMPTS, NEW)
    engine = dcpgraph.compile(program, tp=tp, dcp=dcp, block_size=4, speculative_config=spec(3))
    assert engine.generate(PROMPTS, NEW) == plain
    stats = engine.report()["speculative"]
    assert stats["drafted"] > 0 and stats["accepted"] == stats["drafted"], stats
    assert engine.steps < NEW + 2  # prefill, then 1 + k tokens per step


def test_mtp_with_its_own_head_missing_uses_the_target_head(tmp_path):
    """A checkpoint without ``shared_head.head`` drafts through the target's LM head."""
    from safetensors.torch import load_file, save_file

    from dcpgraph.speculative.mtp_module import eager_mtp_module

    path = save_tiny_checkpoint(tmp_path / "v3", "deepseek_v3", dtype=torch.float64, mtp_weights=True, seed=3)
    weights = load_file(f"{path}/model.safetensors")
    del weights["model.layers.2.shared_head.head.weight"]
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    mtp = eager_mtp_module(path, torch.float64)
    assert mtp.layer.shared_head.head is None
    assert torch.equal(mtp.lm_head.weight, weights["lm_head.weight"])
    program = load_program(path, "float64")
    engine = dcpgraph.compile(program, block_size=4, speculative_config=spec(1))
    plain = dcpgraph.compile(program, block_size=4).generate(PROMPTS[:2], 6)
    assert engine.generate(PROMPTS[:2], 6) == plain
    assert engine.report()["speculative"]["drafted"] > 0


def test_mtp_sampling_is_seeded_and_reproducible(checkpoint):
    """Sampled requests draft from the MTP's distribution (rejection sampling gets it) and a seed
    reproduces the output on a fresh engine."""
    _, program, _ = checkpoint

    def run():
        engine = dcpgraph.compile(program, block_size=4, speculative_config=spec())
        propose, probs = engine.runner.proposer.propose, []

        def recording(plan):
            out = propose(plan)
            probs.extend(d.probs for d in out if d.tokens)
            return out

        engine.runner.proposer.propose = recording
        tokens = engine.generate(PROMPTS[:3], NEW, temperature=0.8, top_k=50, seed=7)
        return tokens, engine.report()["speculative"], probs

    first, stats, probs = run()
    second, _, _ = run()
    assert first == second and stats["drafted"] > 0 and all(len(t) == NEW for t in first)
    assert probs and all(p is not None and torch.allclose(p.sum(-1), torch.ones(len(p), dtype=p.dtype))
                         for p in probs)


def test_mtp_refusals(checkpoint, tmp_path):
    from dcpgraph.models import build_model

    module = build_model("deepseek_v3", dtype=torch.float64)
    with pytest.raises(ConfigError, match=r"module or traced Program has none .* give the checkpoint"):
        dcpgraph.compile(module, speculative_config=spec())
    bare = save_tiny_checkpoint(tmp_path / "bare", "deepseek_v3", dtype=torch.float64)
    with pytest.raises(ConfigError, match=r"num_nextn_predict_layers=1 but holds MTP weights for 0 layer"):
        dcpgraph.compile(load_program(bare, "float64"), speculative_config=spec())
    # without method="mtp" the MTP tensors are ignored, with it they are read
    _, program, plain = checkpoint
    assert dcpgraph.compile(program, block_size=4).generate(PROMPTS[:1], LONG) == plain[:1]


def test_the_target_returns_its_final_hidden_states_only_for_mtp(checkpoint):
    """``return_hidden_states``: output 1 is HF's ``last_hidden_state`` (after the final norm) for
    every token of the step, on every mesh; without ``method="mtp"`` the program is unchanged."""
    import transformers as tf

    from dcpgraph.runtime.step_inputs import Chunk

    path, program, _ = checkpoint
    target = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    tokens = PROMPTS[3]
    with torch.no_grad(), hf_reference(target):
        expected = target.model(input_ids=torch.tensor([tokens]), use_cache=False).last_hidden_state[0]
    for tp, dcp in [(1, 1), (2, 2)]:
        engine = dcpgraph.compile(program, tp=tp, dcp=dcp, block_size=4, speculative_config=spec())
        engine.runner.execute([Chunk(0, tuple(tokens), 0, tuple(range(4)))])
        torch.testing.assert_close(engine.runner.last_hidden, expected, rtol=1e-9, atol=1e-9)
    plain = dcpgraph.compile(program, block_size=4)
    assert plain.program.lowering.hidden_states_output is None
    assert "return_hidden_states" not in plain.program.passes_run()
    plain.runner.execute([Chunk(0, tuple(tokens), 0, tuple(range(4)))])
    assert plain.runner.last_hidden is None


@pytest.mark.gloo
@pytest.mark.slow
def test_gloo_workers_tp2_dcp2_mtp(tmp_path):
    """MTP on two gloo worker processes (each rank runs its own proposer on its own copy of the
    hidden states): greedy tokens as without speculation, every draft of an MTP built to predict
    the target accepted, seeded sampling reproducible."""
    from dcpgraph import LLM, SamplingParams

    path = save_tiny_checkpoint(tmp_path / "v3", "deepseek_v3", dtype=torch.float64, mtp_weights=True)
    make_mtp_predictable(path, 0.0)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=NEW)
    plain = [o.outputs[0].token_ids for o in LLM(model=path, dtype="float64", block_size=4).generate(prompts, greedy)]
    with LLM(model=path, dtype="float64", block_size=4, tensor_parallel_size=2, decode_context_parallel_size=2,
             worker_timeout_s=300, speculative_config=spec()) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == plain
        stats = llm.engine.report()["speculative"]
        assert stats["method"] == "mtp" and stats["drafted"] > 0 and stats["accepted"] == stats["drafted"]
        sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=NEW)
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, sampled)]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sampled)] == first
        procs = llm.engine.procs
    assert [p.exitcode for p in procs] == [0, 0]


@pytest.mark.slow  # ~30 s: captures the target's and the MTP module's graphs at start-up
def test_mtp_graphs_are_captured_at_start_up_and_serving_compiles_nothing_after(checkpoint):
    """With a compiling backend the MTP program's buckets and mixed graph are compiled with the
    target's before any request (zero hidden-state rows, nothing written), so serving compiles
    nothing more, and the tokens are those of the eager run."""
    path, program, plain = checkpoint
    engine = dcpgraph.compile(program, block_size=4, max_num_batched_tokens=8, capture_limit=2, backend="aot_eager",
                              speculative_config=spec())
    captured = set(engine.report()["compile"]["startup_seconds"])
    assert {"draft decode[1]", "draft decode[2]", "draft mixed", "decode[1]", "mixed"} <= captured, captured
    mtp_log = engine.runner.proposer.executor.graphs.log
    assert engine.generate(PROMPTS, LONG) == plain
    assert engine.report()["compile"]["compiles_after_startup"] == 0, engine.report()["compile"]
    assert mtp_log.report()["compiles_after_startup"] == 0, mtp_log.report()
