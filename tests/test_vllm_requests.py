"""vLLM's request fields, endpoints and flags on a real ``dcpgraph serve`` (tp=1, the tiny Qwen3
checkpoint, fp64), talked to with the ``openai`` client and ``httpx``.

References, all independent of dcpgraph's sampling code: HF ``generate`` on the same checkpoint
with its own logits processors (``min_new_tokens`` for ``min_tokens``, ``sequence_bias`` for
``logit_bias``, ``prefix_allowed_tokens_fn`` for ``allowed_token_ids``, ``bad_words_ids`` for
``bad_words``), an argmax loop over HF's logits that never stops (``ignore_eos``), and the
tokenizer itself (``/tokenize``, ``/detokenize``, chat templates). The server is started with
vLLM's flags (``--chat-template``, ``--max-logprobs``, ``--enable-log-requests``,
``--enable-prefix-caching``) and its key from ``VLLM_API_KEY``.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import torch

from dcpgraph.checkpoints.model_dir import load_model, load_tokenizer
from dcpgraph.testing.server import running_server

pytestmark = pytest.mark.slow  # a server subprocess per module (~45 s on 2 cores)

KEY = "sk-vllm-env-key"
LONG = {"model": "tiny", "prompt": "x", "max_tokens": 120, "n": 8, "temperature": 0, "ignore_eos": True}
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if m.tool_call_id is defined %}"
            "#{{ m.tool_call_id }}{% endif %}\n{% endfor %}{% if enable_thinking is defined and not enable_thinking %}"
            "[no-think]{% endif %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_requests")
    template = root / "template.jinja"
    template.write_text(TEMPLATE)
    args = ("--dtype", "float64", "--block-size", "4", "--max-model-len", "128", "--served-model-name", "tiny",
            "--enable-prefix-caching", "--chat-template", str(template), "--max-logprobs", "5",
            "--enable-log-requests", "--enable-chunked-prefill", "--gpu-memory-utilization", "0.002",
            "--generation-config", "vllm")
    with running_server(checkpoints["qwen3"], *args, log_path=str(root / "server.log"),
                        env={"VLLM_API_KEY": KEY, "DCPGRAPH_API_KEY": ""}) as s:
        yield s


@pytest.fixture(scope="module")
def hf(checkpoints):
    return load_model(checkpoints["qwen3"], "float64"), load_tokenizer(checkpoints["qwen3"])


def api(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60, **kwargs)


def hf_generate(model, ids: list[int], n: int, **processors) -> list[int]:
    """HF's greedy ``generate`` with its own logits processors (stops at EOS)."""
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, **processors)
    return out[0, len(ids):].tolist()


def hf_argmax_never_stopping(model, ids: list[int], n: int) -> list[int]:
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(ids):]


def text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def ending_at_eos(model, eos: int) -> tuple[list[int], list[int]]:
    """A one-token prompt whose HF greedy continuation ends with EOS within 12 tokens."""
    for t in range(3, 258):
        out = hf_generate(model, [t], 12)
        if out[-1] == eos:
            return [t], out
    raise AssertionError("no one-token prompt reaches EOS greedily within 12 tokens")


def complete(server, prompt, max_tokens: int, **extra):
    return api(server).completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          extra_body=extra or None)


def test_ignore_eos_and_min_tokens_continue_past_eos_as_hf(server, hf):
    model, tok = hf
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    prompt, stops = ending_at_eos(model, eos)
    plain = complete(server, prompt, 20).choices[0]
    assert plain.finish_reason == "stop" and plain.text == text(tok, stops)
    n = len(stops) + 6
    ignored = complete(server, prompt, n, ignore_eos=True)
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == n
    assert ignored.choices[0].text == text(tok, hf_argmax_never_stopping(model, prompt, n))
    k = len(stops) + 2  # EOS masked until k tokens are out (HF: MinNewTokensLengthLogitsProcessor)
    want = hf_generate(model, prompt, 30, min_new_tokens=k)
    got = complete(server, prompt, 30, min_tokens=k)
    assert got.usage.completion_tokens == len(want) >= k and got.choices[0].text == text(tok, want)


def test_logit_bias_allowed_token_ids_bad_words_and_min_p_match_hf(server, hf):
    model, tok = hf
    prompt = tok.encode("The future of AI is")
    greedy = hf_generate(model, prompt, 12)
    forced = complete(server, prompt, 6, logit_bias={"40": 100})
    assert forced.choices[0].text == text(tok, [40] * 6)
    biased = complete(server, prompt, 12, logit_bias={str(greedy[1]): -3.0, "77": 2.5})
    assert biased.choices[0].text == text(tok, hf_generate(model, prompt, 12,
                                                           sequence_bias={(greedy[1],): -3.0, (77,): 2.5}))
    allowed = [65, 66, 67, 68]
    got = complete(server, prompt, 8, allowed_token_ids=allowed)
    want = hf_generate(model, prompt, 8, prefix_allowed_tokens_fn=lambda batch, ids: allowed)
    assert set(want) <= set(allowed) and got.choices[0].text == text(tok, want)
    word = next(w for w in (tok.decode([t]).strip() for t in greedy) if w.isascii() and w.isalnum())
    assert word in text(tok, greedy)  # the word is there without the ban
    banned = [tok.encode(word, add_special_tokens=False), tok.encode(" " + word, add_special_tokens=False)]
    want = hf_generate(model, prompt, 12, bad_words_ids=banned)
    got = complete(server, prompt, 12, bad_words=[word])
    assert got.choices[0].text == text(tok, want) and got.choices[0].text != text(tok, greedy)
    for seed in (1, 2):  # min_p=1 keeps only the most likely token: sampling is greedy
        sampled = api(server).completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0,
                                                 seed=seed, extra_body={"min_p": 1.0})
        assert sampled.choices[0].text == text(tok, greedy[:8])


def test_truncate_null_defaults_unknown_fields_and_refusals(server, hf):
    model, tok = hf
    ids = tok.encode("a b c d e f g h i j k l m n o p")
    got = complete(server, ids, 5, truncate_prompt_tokens=4)
    assert got.usage.prompt_tokens == 4 and got.choices[0].text == text(tok, hf_generate(model, ids[-4:], 5))
    body = {"model": "tiny", "prompt": "x", "max_tokens": 3, "temperature": None, "top_p": None, "top_k": None,
            "presence_penalty": None, "frequency_penalty": None, "repetition_penalty": None, "stream": None,
            "n": None, "not_a_vllm_field": {"x": 1}, "best_of": 1}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert "fields ignored (this server does not know them): ['not_a_vllm_field']" in server.log()
    refusals = {"best_of": {"prompt": "x", "best_of": 3}, "cannot be compiled": {"prompt": "x", "structured_outputs":
                {"regex": "(ab"}}, "logprobs": {"prompt": "x", "logprobs": 6},
                "vocabulary": {"prompt": "x", "logit_bias": {"99999": 1}}, "min_tokens": {"prompt": "x",
                "max_tokens": 2, "min_tokens": 3}}
    for word, bad in refusals.items():
        r = post(server, "/v1/completions", bad)
        assert r.status_code == 400 and word in r.json()["error"]["message"], (word, r.text)
    big = post(server, "/v1/completions", {"prompt": "z" * (2 << 20), "max_tokens": 1})
    assert big.status_code == 400 and "max_model_len" in big.json()["error"]["message"]  # not a 413


def test_chat_content_parts_tool_messages_and_template_kwargs(server, hf):
    model, tok = hf
    messages = [{"role": "user", "content": [{"type": "text", "text": "héllo"}, {"type": "text", "text": "wörld"}]},
                {"role": "assistant", "content": "ok"}, {"role": "tool", "content": "42", "tool_call_id": "call-1"}]
    rendered = tok.apply_chat_template([{"role": "user", "content": "héllo\nwörld"}, messages[1], messages[2]],
                                       chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)
    assert "#call-1" in rendered and "[no-think]" in rendered
    ids = tok.encode(rendered, add_special_tokens=False)
    got = api(server).chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert got.usage.prompt_tokens == len(ids) and got.choices[0].message.content == text(
        tok, hf_generate(model, ids, 6))
    counted = post(server, "/tokenize", {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    assert counted.json()["tokens"] == ids
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
    with pytest.raises(openai.BadRequestError, match="content part type 'image_url' is not supported"):
        api(server).chat.completions.create(model="tiny", messages=image, max_tokens=2)


def test_tokenize_detokenize_version_ping_load_and_api_key(server, hf):
    _, tok = hf
    r = post(server, "/tokenize", {"prompt": "héllo wörld", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("héllo wörld") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 128
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": tok.decode(r["tokens"])}
    assert post(server, "/detokenize", {"tokens": [99999]}).status_code == 400
    assert httpx.get(server.url + "/version", timeout=10).json()["version"]
    assert httpx.get(server.url + "/ping", timeout=10).status_code == 200
    assert httpx.post(server.url + "/ping", timeout=10).status_code == 200
    assert httpx.get(server.url + "/load", timeout=10).json() == {"server_load": 0}
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401  # VLLM_API_KEY set the key
    worker = threading.Thread(target=post, args=(server, "/v1/completions", {**LONG, "n": 1, "max_tokens": 100}))
    worker.start()
    wait_for(lambda: httpx.get(server.url + "/load", timeout=10).json() == {"server_load": 1})
    worker.join(60)
    assert httpx.get(server.url + "/load", timeout=10).json() == {"server_load": 0}


def test_reset_prefix_cache_and_a_disconnected_non_streamed_request_is_aborted(server, hf):
    _, tok = hf
    prompt = tok.encode("a b c d e f g h i j k l m n o p q r s t")
    complete(server, prompt, 2)
    freed = post(server, "/reset_prefix_cache", {})
    assert freed.status_code == 200 and freed.json()["freed_blocks"] >= len(prompt) // 4 - 1
    assert post(server, "/reset_prefix_cache", {}).json()["freed_blocks"] == 0
    with pytest.raises(httpx.ReadTimeout):  # the client gives up, closing its connection
        httpx.post(server.url + "/v1/completions", json=LONG, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.25)
    wait_for(lambda: "client went away" in server.log())
    wait_for(lambda: httpx.get(server.url + "/load", timeout=10).json() == {"server_load": 0})
    assert "request cmpl-" in server.log() and "SamplingParams(" in server.log()  # --enable-log-requests


def test_streams_carry_continuous_usage_and_the_clients_request_id(server, hf):
    """What ``vllm bench serve`` and guidellm read: every chunk's ``usage`` with
    ``continuous_usage_stats`` (its choice's tokens so far), the final usage chunk, and the id
    made from the client's ``X-Request-Id``."""
    _, tok = hf
    ids = tok.encode("a b c d")
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(api(server).completions.create(model="tiny", prompt=ids, max_tokens=5, n=2, temperature=0,
                                                 extra_body={"ignore_eos": True}, stream=True, stream_options=options,
                                                 extra_headers={"X-Request-Id": "bench-7"}))
    seen = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        choice = chunk.choices[0].index
        seen[choice] += 1
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (len(ids), seen[choice])
    assert seen == {0: 5, 1: 5} and not chunks[-1].choices
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (2 * len(ids), 10)
    assert {c.id for c in chunks} == {"cmpl-bench-7"}
    chat = list(api(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=3, extra_body={"ignore_eos": True}, stream=True,
                                                    stream_options=options))
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0
    assert [c.usage.completion_tokens for c in chat[1:-1]] == [1, 2, 3] and chat[-1].usage.completion_tokens == 3
    plain = list(api(server).completions.create(model="tiny", prompt=ids, max_tokens=2, stream=True,
                                                stream_options={"include_usage": True}))
    assert [c.usage is None for c in plain] == [True, True, False]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ids, "max_tokens": 1}, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "mine"})
    assert r.json()["id"] == r.headers["x-request-id"] == "cmpl-mine"


def wait_for(condition, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)
