"""The offline API (``dcpgraph.LLM`` / ``SamplingParams``) on checkpoints the tests write themselves.

Reference: HF ``generate(do_sample=False)`` on the same directory, loaded by transformers in fp64
(:func:`dcpgraph.testing.generation.hf_greedy`), and the tokenizer's own ``decode``. The engine runs
the same fp64 weights, so greedy tokens must match exactly, at tp=1 in-process and at tp=2/dcp=2 on
two gloo worker processes.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from dcpgraph import LLM, ConfigError, RequestError, SamplingParams, UnsupportedModelError
from dcpgraph.checkpoints.model_dir import load_model, load_tokenizer
from dcpgraph.runtime.engine_client import EngineClient
from dcpgraph.serving.detokenizer import TextStream
from dcpgraph.testing.checkpoints import save_tiny_checkpoint
from dcpgraph.testing.generation import hf_greedy

PROMPTS = ["héllo wörld", "The future of AI is", "x"]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def references(checkpoints):
    """Per checkpoint: the tokenizer and a function prompt ids -> HF greedy new tokens."""
    out = {}
    for arch, path in checkpoints.items():
        model = load_model(path, "float64")
        out[arch] = (load_tokenizer(path), lambda ids, n=MAX_TOKENS, m=model: hf_greedy(m, ids, n))
    return out


@pytest.fixture(scope="module")
def llms(checkpoints):
    made = {arch: LLM(model=path, dtype="float64", block_size=4) for arch, path in checkpoints.items()}
    yield made
    for llm in made.values():
        llm.shutdown()


def assert_matches_hf(outputs, tokenizer, reference):
    for out in outputs:
        want = reference(out.prompt_token_ids)
        got = out.outputs[0]
        assert got.token_ids == want, out.prompt
        assert got.text == tokenizer.decode(want, skip_special_tokens=True)
        assert got.finish_reason == ("stop" if len(want) < MAX_TOKENS else "length")


# -- SamplingParams and the text stream (no model) ----------------------------------------------
def test_sampling_params_has_vllm_defaults_and_checks_values():
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.seed, sp.logprobs) == (1, 1.0, 1.0, 0, 16, None, None)
    assert not sp.greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=-1).engine_params()["top_k"] == 0
    assert SamplingParams(temperature=0.5, seed=7).engine_params(2)["seed"] == 9
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2), dict(max_tokens=0),
                dict(n=0), dict(stop=[""]), dict(stop_token_ids=[-1]), dict(logprobs=21), dict(seed="x"),
                dict(prompt_logprobs=-1), dict(repetition_penalty=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def _stream(tokenizer, text, **params):
    stream = TextStream(tokenizer, SamplingParams(**params), eos_token_ids=[258])
    ids = tokenizer.encode(text)
    deltas = []
    for i, t in enumerate(ids):
        deltas.append(stream.add(t, i == len(ids) - 1))
        if stream.finished:
            break
    return stream, deltas


def test_text_stream_never_splits_a_character_and_stops_on_text(checkpoints):
    tokenizer = load_tokenizer(checkpoints["qwen3"])
    text = "héllo wörld — ok"
    assert len(tokenizer.encode(text)) > len(text)  # multi-byte characters span several tokens
    stream, deltas = _stream(tokenizer, text)
    assert "".join(deltas) == stream.text == text and stream.finish_reason == "length"
    assert all("\ufffd" not in d for d in deltas)
    stream, deltas = _stream(tokenizer, text, stop=["ö"])  # a stop string that is one 2-byte character
    assert stream.text == "".join(deltas) == "héllo w" and stream.finish_reason == "stop"
    stream, deltas = _stream(tokenizer, text, stop=["ld —", "zz"], include_stop_str_in_output=True)
    assert stream.text == "".join(deltas) == "héllo wörld —"
    # while running, the last len("ld —") - 1 = 3 characters are held back: no stop is ever half-streamed
    assert "".join(deltas[: len(tokenizer.encode("héllo wörl"))]) == "héllo w"
    stream, deltas = _stream(tokenizer, text, stop_token_ids=[tokenizer.encode("w")[0]])
    assert stream.text == "héllo " and stream.token_ids[-1] == tokenizer.encode("w")[0]


# -- tp=1, in process -------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v2"])
def test_greedy_text_equals_hf_generate(arch, llms, references):
    llm = llms[arch]
    tokenizer, reference = references[arch]
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.prompt for o in outputs] == PROMPTS
    assert outputs[0].prompt_token_ids == tokenizer.encode(PROMPTS[0])
    assert_matches_hf(outputs, tokenizer, reference)
    ids = outputs[1].prompt_token_ids
    by_ids = llm.generate([ids, {"prompt_token_ids": ids}, {"prompt": PROMPTS[1]}], GREEDY)
    assert all(o.outputs[0].token_ids == outputs[1].outputs[0].token_ids for o in by_ids)
    assert llm.generate(ids, GREEDY)[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
    assert llm.kv_usage_per_rank() == [0.0]


def test_chat_applies_the_template(llms, references):
    llm = llms["qwen3"]
    tokenizer, reference = references["qwen3"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = llm.chat(messages, GREEDY)[0]
    assert out.prompt.startswith("<|im_start|>system\nbe brief<|im_end|>") and out.prompt.endswith("assistant\n")
    assert out.prompt_token_ids == tokenizer.encode(out.prompt, add_special_tokens=False)
    assert_matches_hf([out], tokenizer, reference)
    assert len(llm.chat([messages, messages[1:]], GREEDY)) == 2


def test_stop_strings_and_stop_tokens_end_generation(llms):
    llm = llms["qwen3"]
    full = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].outputs[0]
    stop = full.text[3:5]
    cut = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=stop))[0].outputs[0]
    assert cut.text == full.text[: full.text.index(stop)] and cut.finish_reason == "stop"
    assert full.token_ids[: len(cut.token_ids)] == cut.token_ids
    token = full.token_ids[4]
    by_id = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                    stop_token_ids=[token]))[0].outputs[0]
    assert by_id.token_ids == full.token_ids[: full.token_ids.index(token) + 1] and by_id.finish_reason == "stop"
    assert llm.kv_usage_per_rank() == [0.0]  # the requests cut short were aborted, blocks freed


def test_seeded_sampling_is_reproducible_and_n_gives_n_outputs(llms):
    llm = llms["deepseek_v2"]
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=8, n=3)
    first, second = llm.generate(PROMPTS[0], sp)[0], llm.generate(PROMPTS[0], sp)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1
    assert all(len(o.token_ids) == 8 or o.finish_reason == "stop" for o in first.outputs)


def test_bad_requests_raise_before_queuing_and_the_llm_keeps_serving(llms):
    llm = llms["qwen3"]
    with pytest.raises(RequestError, match="prompt 1: .*max_model_len"):
        llm.generate(["ok", "y" * 10], [GREEDY, SamplingParams(max_tokens=llm.max_model_len)])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10_000]], GREEDY)
    assert llm.kv_usage_per_rank() == [0.0]
    assert llm.generate("x", GREEDY)[0].outputs[0].token_ids


# -- the directory is checked before any rank starts ---------------------------------------------
def test_bad_checkpoints_are_refused_with_clear_errors(tmp_path, checkpoints):
    with pytest.raises(ConfigError, match="local HF model directory"):
        LLM(model=str(tmp_path / "nowhere"))
    big_tokenizer = save_tiny_checkpoint(tmp_path / "big", "llama", tokenizer_vocab_size=384)
    with pytest.raises(ConfigError, match="384 tokens but the model's vocabulary is 321"):
        LLM(model=big_tokenizer)
    with pytest.raises(ConfigError):
        LLM(model=checkpoints["qwen3"], tensor_parallel_size=2, decode_context_parallel_size=4)
    unknown = save_tiny_checkpoint(tmp_path / "unknown", "llama")
    config = json.load(open(os.path.join(unknown, "config.json")))
    config["architectures"] = ["NoSuchModelForCausalLM"]
    json.dump(config, open(os.path.join(unknown, "config.json"), "w"))
    with pytest.raises(UnsupportedModelError, match="NoSuchModelForCausalLM"):
        LLM(model=unknown)
    missing = save_tiny_checkpoint(tmp_path / "missing", "llama")
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(missing, "model.safetensors"))
    del weights["model.layers.1.self_attn.o_proj.weight"]
    save_file(weights, os.path.join(missing, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="o_proj"):
        LLM(model=missing)
    os.remove(os.path.join(missing, "model.safetensors"))
    with pytest.raises(ConfigError, match="no safetensors weights"):
        LLM(model=missing)


def test_dtype_auto_comes_from_the_config(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "bf16", "llama", dtype=torch.bfloat16)
    llm = LLM(model=path, block_size=4)
    assert llm.config.dtype == "bfloat16"
    assert llm.engine.program.facts.dtype == torch.bfloat16
    assert llm.generate("hi", GREEDY)[0].outputs[0].token_ids


# -- tp=2 / dcp=2 on gloo worker processes --------------------------------------------------------
@pytest.mark.gloo
@pytest.mark.parametrize("arch", ["qwen3", pytest.param("deepseek_v2", marks=pytest.mark.slow)])
def test_workers_at_tp2_dcp2_equal_hf(arch, checkpoints, references):
    tokenizer, reference = references[arch]
    with LLM(model=checkpoints[arch], dtype="float64", block_size=4, tensor_parallel_size=2,
             decode_context_parallel_size=2, worker_timeout_s=300) as llm:
        assert llm.engine.memory_report()["dcp"] == 2
        greedy = llm.generate(PROMPTS, GREEDY)
        assert_matches_hf(greedy, tokenizer, reference)
        # the worker group is an EngineClient like the in-process engine: generate runs on the ranks
        assert isinstance(llm.engine, EngineClient) and llm.engine.healthy()
        assert llm.engine.generate([o.prompt_token_ids for o in greedy], GREEDY.max_tokens) == \
            [o.outputs[0].token_ids for o in greedy]
        # the guide's example, verbatim apart from the model path
        outputs = llm.generate(["The future of AI is"], SamplingParams(temperature=0.8, top_p=0.95))
        assert len(outputs[0].outputs[0].token_ids) == 16 or outputs[0].outputs[0].finish_reason == "stop"
        assert llm.kv_usage_per_rank() == [0.0, 0.0]
        # one scheduler for the deployment, on rank 0; rank 1 only runs the steps rank 0 broadcasts,
        # and the front end (this process) holds none of the engine
        ranks = llm.engine.rank_call("process.report", {})
        assert [(r["rank"], r["pid"], r["schedulers"]) for r in ranks] == \
            [(0, llm.engine.worker_pids()[0], 1), (1, llm.engine.worker_pids()[1], 0)]
        assert llm.engine.report()["executor"] == "driver" and not hasattr(llm.engine, "scheduler")
        procs = llm.engine.procs
    assert [p.exitcode for p in procs] == [0, 0]
