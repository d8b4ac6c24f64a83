"""Vocabularies that tp does not divide (GPT-2's 50257, 97, a model vocab padded past its tokenizer).

The vocab-parallel embedding and the LM head are zero-padded to a multiple of ``64·tp`` rows
(``ShardRule.padded``); the gathered logits are cut back to the vocabulary before anything reads
them, so padded ids are never sampled, never in logprobs and never penalised. References: HF's own
``generate`` and ``log_softmax`` on the same weights (fp64), and the full tensor cut by hand.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dcpgraph
from dcpgraph import LLM, SamplingParams
from dcpgraph.checkpoints.model_dir import load_model, load_tokenizer
from dcpgraph.checkpoints.tensor_sources import InMemory, SafetensorsFiles, Stored, read_local
from dcpgraph.models import tiny_config
from dcpgraph.passes.shard_tp import padded_size
from dcpgraph.program import ShardRule
from dcpgraph.testing.checkpoints import save_tiny_checkpoint
from dcpgraph.testing.generation import hf_greedy, hf_reference, record_logits

PROMPTS = ((5, 9, 4, 77, 3), (1, 2), tuple(range(30, 41)))
TOL = {"deepseek_v2": 2e-6}  # HF's DeepSeek-V2 applies its rotary embedding in fp32 even in fp64
MAX_NEW = 8


# -- the rule ---------------------------------------------------------------------------------------
def test_padded_size_rounds_to_whole_64_row_blocks_per_rank():
    assert padded_size(128, 2) is None and padded_size(50256, 4) is None  # divisible: split as it is
    assert padded_size(97, 2) == 128 and padded_size(97, 4) == 256
    assert padded_size(50257, 2) == 50304 and padded_size(50257, 4) == 50432  # vLLM's 50304 at tp 2
    assert padded_size(151665, 8) == 152064


@given(rows=st.integers(1, 300), cols=st.integers(1, 5), tp=st.sampled_from([2, 4, 8]), dim=st.sampled_from([0, 1]))
def test_padded_shards_are_the_padded_tensor_cut_in_tp(rows, cols, tp, dim):
    full = torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols) + 1
    size = full.shape[dim]
    padded = padded_size(size, tp) or size
    rule = ShardRule(dim, padded=padded)
    pieces = [rule.local(full, r, tp) for r in range(tp)]
    assert all(tuple(p.shape) == rule.local_shape(tuple(full.shape), tp) for p in pieces)
    joined = torch.cat(pieces, dim)
    assert joined.shape[dim] == padded
    assert torch.equal(joined.narrow(dim, 0, size), full)
    assert not joined.narrow(dim, size, padded - size).any()  # the padding is exact zeros
    source = InMemory(full, "w")
    assert all(torch.equal(read_local(source, rule, r, tp), p) for r, p in enumerate(pieces))


def test_padded_shards_read_from_safetensors_only_the_rows_they_hold(tmp_path):
    from safetensors.torch import save_file

    full = torch.randn(97, 6)
    save_file({"lm_head.weight": full}, str(tmp_path / "m.safetensors"))
    stored = Stored(SafetensorsFiles(str(tmp_path), ("m.safetensors",)), "lm_head.weight")
    rule = ShardRule(0, padded=padded_size(97, 4))
    pieces = [read_local(stored, rule, r, 4) for r in range(4)]
    assert [tuple(p.shape) for p in pieces] == [(64, 6)] * 4
    assert torch.equal(torch.cat(pieces)[:97], full) and not pieces[2][33:].any() and not pieces[3].any()


# -- dcpgraph.compile on in-memory models -----------------------------------------------------------
def build(arch: str, vocab: int) -> torch.nn.Module:
    import transformers as tf

    config = tiny_config(arch, vocab=vocab)
    config.initializer_range = 0.2
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).to(torch.float64).eval()


CASES = [("qwen3", 97, 2, 2), ("qwen3", 50257, 4, 2), ("deepseek_v2", 97, 4, 4), ("deepseek_v2", 50257, 2, 2)]


@pytest.mark.parametrize(("arch", "vocab", "tp", "dcp"), CASES, ids=[f"{a}-V{v}-tp{t}-dcp{d}" for a, v, t, d in CASES])
def test_compile_with_an_indivisible_vocabulary_gives_hf_tokens_and_logits(arch, vocab, tp, dcp):
    model = build(arch, vocab)
    refs = [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]
    engine = dcpgraph.compile(model, tp=tp, dcp=dcp, block_size=4, max_num_batched_tokens=16)
    rows = record_logits(engine)
    assert engine.generate([list(p) for p in PROMPTS], MAX_NEW) == refs
    assert rows and all(r.shape[-1] == vocab for r in rows)  # padded columns never leave the graph
    head = {s.target: s.shard for s in engine.program.inputs}["lm_head.weight"]
    assert head.padded == padded_size(vocab, tp)
    local = dict(zip([s.target for s in engine.program.inputs if s.kind in ("param", "buffer", "constant")],
                     engine.program.local_state(tp - 1), strict=False))["lm_head.weight"]
    assert local.shape[0] == head.padded // tp  # each rank holds its share of the padded rows
    with torch.no_grad(), hf_reference(model):  # the first step's first row: HF's after prompt 0
        want = model(torch.tensor([PROMPTS[0]])).logits[0, -1]
    tol = TOL.get(arch, 1e-9)
    torch.testing.assert_close(rows[0][0].to(torch.float64), want, rtol=tol, atol=tol)


# -- checkpoints through LLM (logprobs) ------------------------------------------------------------
@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A DeepSeek-V2 (MLA) and a Qwen3 (GQA) checkpoint with 97 token ids (a character tokenizer),
    the Qwen3 one with a model vocabulary of 101, past its tokenizer's 97."""
    root = tmp_path_factory.mktemp("vocab97")
    return {"deepseek_v2": save_tiny_checkpoint(root / "v2", "deepseek_v2", vocab_size=97),
            "qwen3": save_tiny_checkpoint(root / "q3", "qwen3", vocab_size=101, tokenizer_vocab_size=97)}


def hf_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(output)], -1)


@pytest.mark.parametrize(("arch", "tp", "dcp"), [("deepseek_v2", 2, 2), ("qwen3", 4, 1)])
def test_llm_logprobs_over_an_indivisible_vocabulary_equal_hf(small_vocab, arch, tp, dcp):
    path = small_vocab[arch]
    model, tokenizer = load_model(path, "float64"), load_tokenizer(path)
    vocab = model.config.vocab_size
    assert vocab % tp and len(tokenizer) == 97
    params = SamplingParams(temperature=0.9, seed=4, max_tokens=8, logprobs=5, presence_penalty=0.5,
                            frequency_penalty=0.3)
    with LLM(model=path, dtype="float64", block_size=4, tensor_parallel_size=tp, decode_context_parallel_size=dcp,
             distributed_executor_backend="emulated") as llm:
        outs = llm.generate(["The future of AI is", "x"], params)
        greedy = llm.generate(["The future of AI is"], SamplingParams(temperature=0, max_tokens=8))
    for out in outs:
        got = out.outputs[0]
        assert all(0 <= t < vocab for t in got.token_ids)
        ref = hf_logprobs(model, out.prompt_token_ids, got.token_ids)
        for row, token, entry in zip(ref, got.token_ids, got.logprobs, strict=True):
            assert abs(entry[token].logprob - float(row[token])) < 2e-6
            assert all(t < vocab for t in entry)  # no padded id in the top logprobs
            values, ids = torch.topk(row, 5)
            top = sorted((t for t in entry if entry[t].rank <= 5), key=lambda t: entry[t].rank)
            assert top == ids.tolist()
            assert all(abs(entry[t].logprob - float(v)) < 2e-6 for t, v in zip(top, values))
    prompt = greedy[0].prompt_token_ids
    assert greedy[0].outputs[0].token_ids == hf_greedy(model, prompt, 8)
