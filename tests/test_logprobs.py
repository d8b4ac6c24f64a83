"""Log-probabilities and penalties (vLLM's meaning), from the engine to the OpenAI API.

References, all independent of the engine:

- log-probabilities: HF's own forward (``transformers``, fp64) over ``prompt + output``,
  ``log_softmax`` of its logits at each generated position; the engine runs the same fp64 weights,
  so values agree to ~1e-9 and the top-N ids are the same;
- penalties: a by-hand loop over a plain list of logits (the formulas of vLLM's docs), HF's
  ``RepetitionPenaltyLogitsProcessor``, and HF ``generate(repetition_penalty=...)``.
"""

from __future__ import annotations

import math

import openai
import pytest
import torch

from dcpgraph import LLM, SamplingParams
from dcpgraph.checkpoints.model_dir import load_model, load_tokenizer
from dcpgraph.runtime.sampling import apply_penalties, sample, token_logprobs
from dcpgraph.serving.prompts import chat_prompt
from dcpgraph.testing.server import running_server

# fp64 on both sides. Qwen3 and Llama agree to ~1e-15; HF's DeepSeek-V2 applies its rotary embedding in
# fp32 even in an fp64 model (``xq.float()`` + ``torch.polar``), so its reference is only ~1e-7 exact.
EXACT = 1e-9
TOL = {"deepseek_v2": 2e-6}  # per architecture, where not EXACT
PROMPTS = ["The future of AI is", "héllo"]


@pytest.fixture(scope="module")
def hf(checkpoints):
    return {arch: (load_model(path, "float64"), load_tokenizer(path)) for arch, path in checkpoints.items()}


def hf_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """``[len(output), V]``: log_softmax of HF's logits at each generated position."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(output)], -1)


def check_entry(ref_row: torch.Tensor, token: int, logprob: float, top: list[tuple[int, float]], n: int,
                tol: float) -> None:
    """One token's returned figures against HF's row: its logprob and the top-n ids and values."""
    assert abs(logprob - float(ref_row[token])) < tol
    values, ids = torch.topk(ref_row, n)
    assert [t for t, _ in top] == ids.tolist()
    assert all(abs(v - float(w)) < tol for (_, v), w in zip(top, values, strict=True))


# -- the engine's functions, by hand --------------------------------------------------------------
def test_token_logprobs_by_hand():
    logits = torch.tensor([1.0, 3.0, 2.0, 3.0, -1.0], dtype=torch.float64)
    z = math.log(sum(math.exp(x) for x in logits.tolist()))
    entry = token_logprobs(logits, 2, 2)
    assert abs(entry["logprob"] - (2.0 - z)) < 1e-12
    assert entry["rank"] == 3  # two tokens (1 and 3) are more likely
    assert sorted(t for t, _ in entry["top"]) == [1, 3]
    assert all(abs(v - (3.0 - z)) < 1e-12 for _, v in entry["top"])
    assert token_logprobs(logits, 0, 0)["top"] == []


def penalized_by_hand(logits: list[float], prompt, output, presence, frequency, repetition) -> list[float]:
    out = list(logits)
    for t in range(len(out)):
        if t in prompt or t in output:
            out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
        count = sum(1 for o in output if o == t)
        out[t] -= frequency * count + presence * (count > 0)
    return out


@pytest.mark.parametrize("presence,frequency,repetition", [(0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.0, 0.0, 1.3),
                                                           (-0.4, 0.3, 0.8), (1.5, -1.2, 2.0)])
def test_penalties_equal_the_formulas_by_hand(presence, frequency, repetition):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, generator=g, dtype=torch.float64)
    prompt, output = [3, 5, 5, 9], [5, 7, 7, 7, 11, 3]
    params = SamplingParams(temperature=0, presence_penalty=presence, frequency_penalty=frequency,
                            repetition_penalty=repetition)
    got = apply_penalties(logits, params, prompt, output)
    want = penalized_by_hand(logits.tolist(), prompt, output, presence, frequency, repetition)
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    assert sample(logits, params, None, prompt, output) == max(range(40), key=want.__getitem__)
    assert apply_penalties(logits, SamplingParams(), prompt, output) is logits  # none set: untouched


def test_repetition_penalty_equals_hf_logits_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 50, generator=g, dtype=torch.float64)
    ids = [4, 8, 8, 15, 42, 49]
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([ids]), logits.clone())[0]
    got = apply_penalties(logits[0], SamplingParams(repetition_penalty=1.7), ids[:2], ids[2:])
    assert torch.equal(got, want)


def test_bad_values_are_refused_by_name():
    for kwargs, name in [({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
                         ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"presence_penalty": 2.5}, "presence_penalty"),
                         ({"frequency_penalty": -3}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)


# -- the offline API at tp=1 against HF ------------------------------------------------------------
@pytest.fixture(scope="module")
def llms(checkpoints):
    made = {arch: LLM(model=path, dtype="float64", block_size=4) for arch, path in checkpoints.items()}
    yield made
    for llm in made.values():
        llm.shutdown()


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v2"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_llm_logprobs_equal_hf_log_softmax(arch, temperature, llms, hf):
    model, tokenizer = hf[arch]
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=8, logprobs=4)
    for out in llms[arch].generate(PROMPTS, params):
        got = out.outputs[0]
        ref = hf_logprobs(model, out.prompt_token_ids, got.token_ids)
        assert len(got.logprobs) == len(got.token_ids)
        for row, token, entry in zip(ref, got.token_ids, got.logprobs):
            first = next(iter(entry))
            assert first == token and entry[token].rank == int((row > row[token]).sum()) + 1
            top = sorted(((t, lp.logprob) for t, lp in entry.items() if lp.rank <= 4), key=lambda x: -x[1])
            check_entry(row, token, entry[token].logprob, top, 4, TOL.get(arch, EXACT))
            assert entry[token].decoded_token == tokenizer.decode([token])
            if temperature == 0:
                assert entry[token].rank == 1  # greedy picks the most likely token
        assert abs(got.cumulative_logprob - sum(float(ref[i, t]) for i, t in enumerate(got.token_ids))) < len(ref) * TOL.get(arch, EXACT)


def test_llm_without_logprobs_returns_none(llms):
    got = llms["qwen3"].generate("x", SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert got.logprobs is None and got.cumulative_logprob is None


def test_greedy_repetition_penalty_equals_hf_generate(llms, hf):
    model, _ = hf["qwen3"]
    params = SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.5)
    for out in llms["qwen3"].generate(PROMPTS, params):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                  repetition_penalty=1.5, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == want


def greedy_by_hand(model, prompt: list[int], n: int, presence: float, frequency: float, eos) -> list[int]:
    """Greedy decoding with HF's forward and the penalties applied by :func:`penalized_by_hand`."""
    out: list[int] = []
    while len(out) < n and not (out and out[-1] in eos):
        with torch.no_grad():
            row = model(torch.tensor([prompt + out])).logits[0, -1].double().tolist()
        scores = penalized_by_hand(row, [], out, presence, frequency, 1.0)
        out.append(max(range(len(scores)), key=scores.__getitem__))
    return out


def test_greedy_presence_and_frequency_penalties_equal_a_by_hand_loop(llms, hf):
    model, _ = hf["qwen3"]
    presence, frequency = 0.8, 0.6
    params = SamplingParams(temperature=0, max_tokens=10, presence_penalty=presence, frequency_penalty=frequency)
    eos = set(llms["qwen3"].eos_token_ids)
    for out in llms["qwen3"].generate(PROMPTS, params):
        want = greedy_by_hand(model, list(out.prompt_token_ids), 10, presence, frequency, eos)
        assert out.outputs[0].token_ids == want
        plain = llms["qwen3"].generate([out.prompt_token_ids], SamplingParams(temperature=0, max_tokens=10))
        assert plain[0].outputs[0].token_ids != want or len(set(want)) == len(want)


# -- the engine with speculative drafts and DCP: one entry per emitted token, drafts included ---------
def test_engine_logprobs_with_accepted_drafts_and_penalties_turning_drafts_off():
    """llama falls into loops that prompt lookup predicts, so steps emit several tokens; each
    carries the log-probabilities of its own query row. A penalized request never drafts."""
    import dcpgraph
    from dcpgraph.models import build_model

    model = build_model("llama", dtype=torch.float64)
    engine = dcpgraph.compile(dcpgraph.trace(model), tp=2, dcp=2, block_size=4,
                              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    rid = engine.add_request(prompt, 16, logprobs=3)
    tokens, entries = [], []
    while engine.scheduler.has_work():
        for event in engine.step():
            assert event.request_id == rid
            tokens.append(event.token)
            entries.append(event.logprobs)
    assert engine.report()["speculative"]["accepted"] > 0 and engine.steps < len(tokens)
    ref = hf_logprobs(model, prompt, tokens)
    for row, token, entry in zip(ref, tokens, entries, strict=True):
        check_entry(row, token, entry["logprob"], entry["top"], 3, EXACT)
        assert entry["rank"] == 1
    drafted = engine.report()["speculative"]["drafted"]
    engine.generate([prompt], 8, repetition_penalty=1.2)
    assert engine.report()["speculative"]["drafted"] == drafted


# -- the server at tp=2 / dcp=2 (gloo workers) with the openai client --------------------------------
@pytest.mark.slow
@pytest.mark.gloo
def test_server_logprobs_and_penalties_equal_hf_completions_and_chat_streaming_and_not(checkpoints, hf, tmp_path):
    model, tokenizer = hf["qwen3"]
    args = ("-tp", "2", "-dcp", "2", "--dtype", "float64", "--block-size", "4", "--max-model-len", "128",
            "--served-model-name", "tiny")
    with running_server(checkpoints["qwen3"], *args, log_path=str(tmp_path / "server.log")) as server:
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        prompt_ids = tokenizer.encode(PROMPTS[0])

        def check_completion(ids, tokens, token_logprobs, top_logprobs, offsets, n):
            ref = hf_logprobs(model, prompt_ids, ids)
            assert tokens == [tokenizer.decode([t]) for t in ids]
            assert offsets == [sum(len(s) for s in tokens[:i]) for i in range(len(tokens))]
            for row, token, lp, top in zip(ref, ids, token_logprobs, top_logprobs):
                want: dict[str, float] = {}
                for v, t in zip(*torch.topk(row, n)):
                    want.setdefault(tokenizer.decode([int(t)]), float(v))
                assert abs(lp - float(row[token])) < EXACT
                assert top.keys() == want.keys() and all(abs(top[k] - want[k]) < EXACT for k in want)

        done = api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3)
        lp = done.choices[0].logprobs
        # greedy: each token is HF's most likely one at its position, so HF's greedy loop gives the ids
        greedy_ids: list[int] = []
        for _ in range(len(lp.tokens)):
            greedy_ids.append(int(torch.argmax(hf_logprobs(model, prompt_ids + greedy_ids, [0])[0])))
        check_completion(greedy_ids, lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, 3)

        stream = api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3,
                                        stream=True)
        parts = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs:
                for key in parts:
                    parts[key] += getattr(chunk.choices[0].logprobs, key)
        assert parts["tokens"] == lp.tokens
        check_completion(greedy_ids, parts["tokens"], parts["token_logprobs"], parts["top_logprobs"],
                         parts["text_offset"], 3)

        messages = [{"role": "user", "content": "hi"}]
        chat_ids = list(chat_prompt(tokenizer, messages).token_ids)  # the template is tested in test_llm
        reply = api.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0.7, seed=5,
                                            logprobs=True, top_logprobs=2)
        content = reply.choices[0].logprobs.content
        streamed = []
        for chunk in api.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0.7,
                                                 seed=5, logprobs=True, top_logprobs=2, stream=True):
            if chunk.choices and chunk.choices[0].logprobs:
                streamed += chunk.choices[0].logprobs.content
        assert [c.token for c in streamed] == [c.token for c in content]  # same seed, same tokens
        # the sampled ids, recovered from the texts by walking HF's ranking (texts are unique here)
        output_ids = []
        for item in content:
            row = hf_logprobs(model, chat_ids + output_ids, [0])[0]
            candidates = [t for t in range(row.numel()) if tokenizer.decode([t]) == item.token]
            token = min(candidates, key=lambda t: abs(float(row[t]) - item.logprob))
            output_ids.append(token)
            assert abs(item.logprob - float(row[token])) < EXACT
            assert item.bytes == list(item.token.encode())
            values, ids = torch.topk(row, 2)
            assert [t.token for t in item.top_logprobs] == [tokenizer.decode([int(i)]) for i in ids]
            assert all(abs(t.logprob - float(v)) < EXACT for t, v in zip(item.top_logprobs, values))
        for item, other in zip(content, streamed):
            assert abs(item.logprob - other.logprob) < EXACT

        # penalties through the API: OpenAI's presence/frequency, vLLM's repetition_penalty extension
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                  repetition_penalty=1.5, pad_token_id=0)[0, ids.shape[1]:].tolist()
        got = api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                     extra_body={"repetition_penalty": 1.5})
        assert got.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
        want = greedy_by_hand(model, prompt_ids, 8, 0.8, 0.6, {tokenizer.eos_token_id})
        got = api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                     presence_penalty=0.8, frequency_penalty=0.6)
        assert got.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)

        with pytest.raises(openai.BadRequestError, match="top_logprobs"):
            api.chat.completions.create(model="tiny", messages=messages, max_tokens=2, top_logprobs=2)
        with pytest.raises(openai.BadRequestError, match="logprobs"):
            api.completions.create(model="tiny", prompt="x", max_tokens=2, logprobs=21)
