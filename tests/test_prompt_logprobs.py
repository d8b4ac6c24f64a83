"""Prompt log-probabilities (vLLM's ``prompt_logprobs``) from the engine and the offline API.

Reference, independent of the engine: HF's own forward over the prompt (the same fp64 weights),
``log_softmax`` of its logits, row ``p`` scoring prompt token ``p + 1``; the first prompt token
has no entry. Checked through chunked prefill (a prompt split over several steps), prefix caching
(a request asking for them runs its whole prompt, cached or not), a preemption in the middle of a
prompt, tp=2/dcp=2 emulated and (slow tier) on a gloo worker group.
"""

from __future__ import annotations

import pytest
import torch

import dcpgraph
from dcpgraph import LLM, SamplingParams
from dcpgraph.errors import RequestError
from dcpgraph.models import build_model

EXACT = 1e-9  # fp64 on both sides
PROMPT = [5, 17, 3, 99, 42, 8, 8, 61, 7, 23, 11, 64, 2]


@pytest.fixture(scope="module")
def qwen3():
    return build_model("qwen3", dtype=torch.float64)


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt) - 1, V]``: row ``j`` scores prompt token ``j + 1``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].double()
    return torch.log_softmax(logits[:-1], -1)


def check_prompt_entries(model, prompt: list[int], entries: list, top: int) -> None:
    """``entries`` (the engine's, one per prompt token) against HF's rows."""
    assert len(entries) == len(prompt) and entries[0] is None
    ref = hf_prompt_logprobs(model, prompt)
    for j, entry in enumerate(entries[1:]):
        row, token = ref[j], prompt[j + 1]
        assert abs(entry["logprob"] - float(row[token])) < EXACT
        assert entry["rank"] == int((row > row[token]).sum()) + 1
        values, ids = torch.topk(row, top)
        assert [t for t, _ in entry["top"]] == ids.tolist()
        assert all(abs(v - float(w)) < EXACT for (_, v), w in zip(entry["top"], values, strict=True))


def run_one(engine, prompt: list[int], max_new_tokens: int = 3, **sampling) -> tuple[list[int], list | None]:
    rid = engine.add_request(prompt, max_new_tokens, **sampling)
    tokens, prompt_entries = [], None
    while engine.scheduler.has_work():
        for event in engine.step():
            assert event.request_id == rid
            if event.prompt_logprobs is not None:
                assert not tokens, "prompt log-probabilities come with the first token only"
                prompt_entries = event.prompt_logprobs
            tokens.append(event.token)
    return tokens, prompt_entries


@pytest.mark.parametrize("budget", [256, 5], ids=["one-step", "chunked-prefill"])
def test_engine_prompt_logprobs_equal_hf(qwen3, budget):
    engine = dcpgraph.compile(dcpgraph.trace(qwen3), block_size=4, max_num_batched_tokens=budget)
    plain, none = run_one(engine, PROMPT)
    assert none is None
    tokens, entries = run_one(engine, PROMPT, prompt_logprobs=4)
    check_prompt_entries(qwen3, PROMPT, entries, 4)
    assert tokens == plain  # asking for them changes nothing else
    if budget == 5:
        assert engine.steps >= 2 * (len(PROMPT) // 5 + 1)


def test_prompt_logprobs_request_runs_its_cached_prompt(qwen3):
    """With prefix caching on, a request asking for prompt log-probabilities reads no cached
    block (vLLM's rule): its whole prompt runs, so every entry exists and is exact."""
    engine = dcpgraph.compile(dcpgraph.trace(qwen3), tp=2, dcp=2, block_size=2, enable_prefix_caching=True)
    run_one(engine, PROMPT)  # fills the cache with the prompt's full blocks
    before = engine.prefix_cache_report()
    assert before["cached_blocks"] > 0
    _, entries = run_one(engine, PROMPT, prompt_logprobs=2)
    check_prompt_entries(qwen3, PROMPT, entries, 2)
    after = engine.prefix_cache_report()
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == len(PROMPT)
    run_one(engine, PROMPT)  # without them, the same prompt hits again
    assert engine.prefix_cache_report()["prompt_tokens_computed"] - after["prompt_tokens_computed"] < len(PROMPT)


def test_prompt_logprobs_survive_a_preemption_mid_prompt(qwen3):
    """A request preempted between two prefill chunks recomputes its prompt; the entries already
    recorded are not recorded twice."""
    prompt = PROMPT + [9, 4, 77, 31, 15]
    engine = dcpgraph.compile(dcpgraph.trace(qwen3), block_size=2, num_blocks=12, max_num_batched_tokens=6)
    old = engine.add_request([1, 2, 3], 12)  # admitted first: grows during the newcomer's prefill
    new = engine.add_request(prompt, 2, prompt_logprobs=1)
    entries = None
    while engine.scheduler.has_work():
        for event in engine.step():
            if event.request_id == new and event.prompt_logprobs is not None:
                entries = event.prompt_logprobs
    assert engine.scheduler_report()["preemptions"] >= 1 and old != new
    check_prompt_entries(qwen3, prompt, entries, 1)


def test_prompt_logprobs_refused_on_prefill_decode_transfer(qwen3):
    engine = dcpgraph.compile(dcpgraph.trace(qwen3), block_size=4)
    with pytest.raises(RequestError, match="prompt_logprobs is not supported with prefill/decode"):
        engine.prefill(PROMPT, prompt_logprobs=1)
    assert not engine.scheduler.has_work()


def test_prompt_logprobs_values_are_checked():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    assert SamplingParams(prompt_logprobs=0, temperature=0).engine_params() == {"prompt_logprobs": 0}
    assert SamplingParams(prompt_logprobs=2).engine_params(1)["prompt_logprobs"] == 2


def check_request_output(model, out, top: int) -> None:
    """vLLM's ``RequestOutput.prompt_logprobs``: None, then {id: Logprob} with the prompt token and the top ones."""
    prompt = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    ref = hf_prompt_logprobs(model, prompt)
    for j, entry in enumerate(out.prompt_logprobs[1:]):
        token = prompt[j + 1]
        assert abs(entry[token].logprob - float(ref[j, token])) < EXACT
        top_ids = [t for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank) if lp.rank <= top]
        assert set(top_ids) <= set(torch.topk(ref[j], top).indices.tolist())


def test_llm_generate_returns_prompt_logprobs(checkpoints):
    from dcpgraph.checkpoints.model_dir import load_model

    model = load_model(checkpoints["qwen3"], "float64")
    with LLM(model=checkpoints["qwen3"], dtype="float64", block_size=4, max_num_batched_tokens=4) as llm:
        outs = llm.generate(["The future of AI is", "héllo"], SamplingParams(temperature=0, max_tokens=2,
                                                                           prompt_logprobs=3, n=2))
        for out in outs:
            check_request_output(model, out, 3)
            assert out.prompt_logprobs[1][out.prompt_token_ids[1]].decoded_token == \
                llm.tokenizer.decode([out.prompt_token_ids[1]])
        assert llm.generate("x y", SamplingParams(max_tokens=1))[0].prompt_logprobs is None


@pytest.mark.slow
@pytest.mark.gloo
def test_worker_group_tp2_dcp2_prompt_logprobs_equal_hf(checkpoints):
    """The step-broadcast driver: rank 0 schedules, both ranks run, the entries cross the pipe."""
    from dcpgraph.checkpoints.model_dir import load_model

    model = load_model(checkpoints["qwen3"], "float64")
    with LLM(model=checkpoints["qwen3"], dtype="float64", block_size=4, tensor_parallel_size=2,
             decode_context_parallel_size=2, max_num_batched_tokens=6, worker_timeout_s=300) as llm:
        assert llm.engine.report()["executor"] == "driver"
        for out in llm.generate(["The future of AI is", "héllo wörld"],
                                SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)):
            check_request_output(model, out, 2)
