"""``echo`` and ``prompt_logprobs`` on the OpenAI endpoints, in process (the app on a test client).

vLLM's semantics: the prompt's text in front of the completion's; with ``logprobs`` the entries
cover the prompt tokens too, the first one ``null``; ``max_tokens: 0`` returns the prompt alone.
Values are checked against HF's own forward over the same fp64 weights (log_softmax of its
logits, row ``p`` scoring prompt token ``p + 1``), which is what lm-eval's loglikelihood reads.
"""

from __future__ import annotations

import json

import pytest
import torch
from starlette.testclient import TestClient

from dcpgraph import LLM
from dcpgraph.checkpoints.model_dir import load_model
from dcpgraph.serving.api_server import build_app

EXACT = 1e-9
PROMPT = "The future of AI is"


@pytest.fixture(scope="module")
def served(checkpoints):
    llm = LLM(model=checkpoints["qwen3"], dtype="float64", block_size=4)
    with TestClient(build_app(llm, served_model_name="m")) as client:
        yield client, llm.tokenizer, load_model(checkpoints["qwen3"], "float64")
    llm.shutdown()


def hf_rows(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids) - 1, V]``: row ``j`` scores token ``j + 1``."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), -1)


def post(client, path: str, body: dict) -> dict:
    reply = client.post(path, json={"model": "m", "temperature": 0, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_echo_with_zero_max_tokens_returns_the_prompt_and_its_logprobs(served):
    client, tokenizer, model = served
    ids = tokenizer.encode(PROMPT)
    choice = post(client, "/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 0})
    choice = choice["choices"][0]
    assert choice["text"] == PROMPT
    lp = choice["logprobs"]
    assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = hf_rows(model, ids)
    for j, (got, top) in enumerate(zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True)):
        assert abs(got - float(ref[j, ids[j + 1]])) < EXACT
        assert len(top) <= 2 and abs(max(top.values()) - float(ref[j].max())) < EXACT
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    # the prompt log-probabilities, vLLM's field: null, then {id: {logprob, rank, decoded_token}}
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert abs(plp[1][str(ids[1])]["logprob"] - float(ref[0, ids[1]])) < EXACT


def test_echo_puts_the_prompt_in_front_of_the_completion(served):
    client, tokenizer, model = served
    ids = tokenizer.encode(PROMPT)
    plain = post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "logprobs": 1})["choices"][0]
    echoed = post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "logprobs": 1,
                                              "echo": True})["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"]
    lp = echoed["logprobs"]
    assert lp["token_logprobs"][len(ids):] == plain["logprobs"]["token_logprobs"]
    assert lp["tokens"][len(ids):] == plain["logprobs"]["tokens"]
    # the whole sequence's log-probabilities are HF's over prompt + completion
    full = ids + tokenizer.encode(plain["text"], add_special_tokens=False)
    ref = hf_rows(model, full)
    assert all(abs(lp["token_logprobs"][i] - float(ref[i - 1, full[i]])) < EXACT for i in range(1, len(ids)))
    # without logprobs, echo is text only; a token-id prompt is echoed decoded
    bare = post(client, "/v1/completions", {"prompt": ids, "max_tokens": 4, "echo": True})["choices"][0]
    assert bare["text"] == tokenizer.decode(ids) + plain["text"] and bare["logprobs"] is None


def test_streamed_echo_equals_the_whole_answer(served):
    client, _, _ = served
    body = {"model": "m", "temperature": 0, "prompt": PROMPT, "max_tokens": 4, "logprobs": 1, "echo": True}
    whole = post(client, "/v1/completions", body)["choices"][0]
    texts, token_logprobs = [], []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    texts.append(choice["text"])
                    token_logprobs += choice["logprobs"]["token_logprobs"]
    assert texts[0].startswith(PROMPT) and "".join(texts) == whole["text"]
    assert token_logprobs == whole["logprobs"]["token_logprobs"]


def test_prompt_logprobs_field_on_completions_and_chat(served):
    client, tokenizer, model = served
    ids = tokenizer.encode(PROMPT)
    choice = post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 3,
                                              "n": 2})["choices"]
    ref = hf_rows(model, ids)
    for c in choice:
        plp = c["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(ids) and c["logprobs"] is None
        for j, entry in enumerate(plp[1:]):
            assert abs(entry[str(ids[j + 1])]["logprob"] - float(ref[j, ids[j + 1]])) < EXACT
            ranked = sorted((v["rank"], int(k)) for k, v in entry.items() if v["rank"] <= 3)
            assert [k for _, k in ranked] == torch.topk(ref[j], 3).indices.tolist()
    chat = post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                 "prompt_logprobs": 0})
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert "prompt_logprobs" not in post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})["choices"][0]


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "0 is accepted only with echo"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "not available when stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "/v1/completions supports echo"),
])
def test_bad_echo_and_prompt_logprobs_requests_are_refused_by_name(served, path, body, needle):
    client, _, _ = served
    reply = client.post(path, json={"model": "m", **body})
    assert reply.status_code == 400 and needle in reply.json()["error"]["message"], reply.text


def stream_chunks(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={"model": "m", "temperature": 0, "stream": True, **body}) as reply:
        assert reply.status_code == 200
        lines = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def test_return_token_ids_are_hfs_greedy_tokens_whole_and_streamed(served):
    """vLLM's ``return_token_ids``: the prompt's ids and each choice's generated ids, which for a
    greedy request are HF's own ``generate`` on the same weights; a stream's chunks carry the same
    ids piece by piece, the prompt's on a choice's first chunk only."""
    from dcpgraph.testing.generation import hf_greedy

    client, tokenizer, model = served
    ids = tokenizer.encode(PROMPT)
    want = hf_greedy(model, ids, 6)
    whole = post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "return_token_ids": True})
    choice = whole["choices"][0]
    assert choice["prompt_token_ids"] == ids and choice["token_ids"] == want
    assert tokenizer.decode(want) == choice["text"]
    chunks = stream_chunks(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "return_token_ids": True})
    assert [c["choices"][0]["token_ids"] for c in chunks if c["choices"]] != [want]  # more than one piece
    assert sum((c["choices"][0]["token_ids"] for c in chunks if c["choices"]), []) == want
    assert [("prompt_token_ids" in c["choices"][0]) for c in chunks if c["choices"]] == \
        [True] + [False] * (len([c for c in chunks if c["choices"]]) - 1)
    echoed = post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "return_token_ids": True})
    assert echoed["choices"][0]["token_ids"] == [] and echoed["choices"][0]["text"] == PROMPT
    messages = [{"role": "user", "content": "hi"}]
    chat = post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "return_token_ids": True})
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chat_ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert chat["prompt_token_ids"] == chat_ids and chat["choices"][0]["token_ids"] == hf_greedy(model, chat_ids, 4)
    chunks = stream_chunks(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 4,
                                                           "return_token_ids": True})
    assert chunks[0]["prompt_token_ids"] == chat_ids and all("prompt_token_ids" not in c for c in chunks[1:])
    assert sum((c["choices"][0].get("token_ids", []) for c in chunks if c["choices"]), []) == \
        chat["choices"][0]["token_ids"]
    plain = post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
