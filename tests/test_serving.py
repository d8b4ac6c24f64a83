"""``dcpgraph serve`` as a real server: a subprocess on a free 127.0.0.1 port, 2 gloo worker ranks
(tp=2, dcp=2), talked to with the official ``openai`` client and ``httpx``; every loop is bounded
and the server is stopped by the fixture that started it.

Reference: HF ``generate(do_sample=False)`` + the tokenizer's ``decode`` on the same checkpoint
(fp64, as the server runs it). The GQA (Qwen3) server requires an API key; the MLA (DeepSeek-V2)
one does not. The last test kills a worker, so it runs last on its own server.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import openai
import pytest

from dcpgraph.checkpoints.model_dir import load_model, load_tokenizer
from dcpgraph.testing.generation import hf_greedy
from dcpgraph.testing.pd import kv_usage
from dcpgraph.testing.prometheus import samples, scrape
from dcpgraph.testing.server import running_server

pytestmark = [pytest.mark.gloo, pytest.mark.slow]  # two tp=2 servers, ~3 min on 2 cores
KEY = "sk-test-key"
MAX_MODEL_LEN = 256
SERVER_ARGS = ("-tp", "2", "-dcp", "2", "--dtype", "float64", "--block-size", "4",
               "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--served-model-name", "tiny",
               "--max-request-bytes", str(1 << 20))
PROMPTS = ["héllo wörld", "The future of AI is", "x", "a b c d e f g h i j k"]


@pytest.fixture(scope="module")
def servers(checkpoints, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    with running_server(checkpoints["qwen3"], *SERVER_ARGS, "--api-key", KEY, log_path=str(logs / "gqa.log")) as gqa, \
            running_server(checkpoints["deepseek_v2"], *SERVER_ARGS, log_path=str(logs / "mla.log")) as mla:
        yield {"qwen3": gqa, "deepseek_v2": mla}


@pytest.fixture(scope="module")
def reference(checkpoints):
    """``reference(arch, prompt_ids, max_tokens)`` -> the text HF generates greedily."""
    cache = {arch: (load_model(path, "float64"), load_tokenizer(path)) for arch, path in checkpoints.items()}

    def text(arch, ids, max_tokens):
        model, tokenizer = cache[arch]
        return tokenizer.decode(hf_greedy(model, ids, max_tokens), skip_special_tokens=True)

    text.tokenizer = lambda arch: cache[arch][1]
    return text


def client(server, key=KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def wait_idle(server, timeout_s: float = 60) -> None:
    """Until the server reports no request and no KV block in use (the engine's one figure and
    every rank's)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if scrape(server, "vllm:kv_cache_usage_perc") == [0.0] \
                and scrape(server, "dcpgraph:kv_cache_usage_perc_per_rank") == [0.0, 0.0] \
                and scrape(server, "vllm:num_requests_running") == [0] and scrape(server, "vllm:num_requests_waiting") == [0]:
            return
        time.sleep(0.25)
    raise AssertionError(f"KV blocks still in use: {kv_usage(server)}")


def test_models_health_and_api_key(servers):
    gqa = servers["qwen3"]
    assert httpx.get(gqa.url + "/health", timeout=10).status_code == 200
    refused = httpx.get(gqa.url + "/v1/models", timeout=10)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert httpx.get(gqa.url + "/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client(gqa, "wrong").models.list()
    assert [m.id for m in client(gqa).models.list().data] == ["tiny"]
    assert [m.id for m in client(servers["deepseek_v2"], "unused").models.list().data] == ["tiny"]


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v2"])
def test_greedy_completions_and_chat_equal_hf(arch, servers, reference):
    server, tok = servers[arch], reference.tokenizer(arch)
    api = client(server)
    for prompt in PROMPTS[:3]:
        want = reference(arch, tok.encode(prompt), 10)
        got = api.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
        assert got.choices[0].text == want and got.usage.completion_tokens <= 10
        chunks = list(api.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == want
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    messages = [{"role": "user", "content": "héllo"}]
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    want = reference(arch, ids, 12)
    chat = api.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == want and chat.choices[0].message.role == "assistant"
    stream = api.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        pieces += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == want and usage.prompt_tokens == len(ids)
    wait_idle(server)


def test_bad_requests_get_openai_shaped_400s(servers):
    server = servers["qwen3"]
    url = server.url + "/v1/completions"
    cases = {
        "malformed JSON": dict(content=b'{"prompt": "x",'),
        "best_of other than n": dict(json={"prompt": "x", "best_of": 2}),
        "max_tokens past max_model_len": dict(json={"prompt": "x", "max_tokens": MAX_MODEL_LEN}),
        "prompt too long": dict(json={"prompt": "y" * (MAX_MODEL_LEN + 5), "max_tokens": 1}),
        "bad temperature": dict(json={"prompt": "x", "temperature": -1}),
        "bad top_p": dict(json={"prompt": "x", "top_p": 2}),
        "bad n": dict(json={"prompt": "x", "n": 0}),
        "token outside the vocabulary": dict(json={"prompt": [1, 2, 99999]}),
        "not an object": dict(json=[1, 2]),
        "penalty out of range": dict(json={"prompt": "x", "presence_penalty": 2.5}),
        "logprobs past 20": dict(json={"prompt": "x", "logprobs": 21}),
    }
    for name, kwargs in cases.items():
        r = httpx.post(url, headers=auth(), timeout=30, **kwargs)
        assert r.status_code == 400, (name, r.status_code, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, name
    r = httpx.post(server.url + "/v1/chat/completions", headers=auth(), timeout=30, json={"messages": [{"role": "x"}]})
    assert r.status_code == 400
    r = httpx.post(url, headers=auth(), timeout=30, json={"prompt": "x", "model": "other"})
    assert r.status_code == 404
    r = httpx.post(url, headers=auth(), timeout=30, content=b'{"prompt": "' + b"z" * (2 << 20) + b'"}')
    assert r.status_code == 413
    with pytest.raises(openai.BadRequestError):
        client(server).completions.create(model="tiny", prompt="x", max_tokens=MAX_MODEL_LEN)
    assert client(server).completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0).choices[0].text is not None
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_32_concurrent_streaming_clients(servers, reference):
    """24 good streams, 4 that disconnect after two chunks, 4 bad requests, all at once: the good
    ones get HF's text, the server frees every block and stays healthy."""
    server, tok = servers["qwen3"], reference.tokenizer("qwen3")
    jobs = [("good", PROMPTS[i % len(PROMPTS)], 4 + (i * 7) % 20) for i in range(24)]
    jobs += [("drop", PROMPTS[i % len(PROMPTS)], 60) for i in range(4)]
    jobs += [("bad", "x", -1), ("bad", "x", MAX_MODEL_LEN), ("bad", "y" * 300, 2), ("bad", "x", 0)]
    want = {(p, n): reference("qwen3", tok.encode(p), n) for kind, p, n in jobs if kind == "good"}

    async def one(http: httpx.AsyncClient, kind: str, prompt: str, n: int):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if kind == "bad":
                await r.aread()
                return r.status_code
            assert r.status_code == 200
            text, chunks = "", 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                assert "error" not in data, data
                text += data["choices"][0]["text"]
                chunks += 1
                if kind == "drop" and chunks == 2:
                    return "dropped"  # leaving the block closes the connection mid-stream
            return text

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=auth(), timeout=300) as http:
            return await asyncio.gather(*(one(http, *job) for job in jobs))

    results = asyncio.run(asyncio.wait_for(run(), 600))
    for (kind, prompt, n), result in zip(jobs, results):
        if kind == "good":
            assert result == want[(prompt, n)], (prompt, n)
        elif kind == "bad":
            assert result == 400
        else:
            assert result == "dropped"
    wait_idle(server)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert scrape(server, "vllm:time_to_first_token_seconds_count")[0] >= 24
    assert scrape(server, "vllm:generation_tokens_total")[0] > 0
    assert "aborted" in server.log() or "client went away" in server.log()
    assert re.search(r"request cmpl-[0-9a-f]{32}: finished", server.log())


COUNTED = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:iteration_tokens_total_sum",
           "vllm:e2e_request_latency_seconds_count", "vllm:time_to_first_token_seconds_count",
           "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
           "vllm:request_decode_time_seconds_count", "vllm:request_params_n_sum", "vllm:request_params_n_count",
           "vllm:request_max_num_generation_tokens_sum", "vllm:request_generation_tokens_sum")


def test_metrics_count_a_request_as_vllm_does(servers):
    """One request with n=2 through the openai client: /metrics (read with prometheus_client's
    parser, text and OpenMetrics) moves by exactly what the response's usage says, in vLLM's
    meaning: two engine requests, each counting its prompt, one parent request of n=2."""
    server = servers["qwen3"]
    wait_idle(server)
    before = {name: sum(scrape(server, name)) for name in COUNTED}
    reasons_before = {r: sum(scrape(server, "vllm:request_success_total", finished_reason=r)) for r in ("stop", "length")}
    out = client(server).completions.create(model="tiny", prompt="héllo wörld", max_tokens=6, n=2, temperature=0)
    usage, per_choice = out.usage, [c for c in out.choices]
    delta = {name: sum(scrape(server, name)) - before[name] for name in COUNTED}
    assert delta["vllm:prompt_tokens_total"] == usage.prompt_tokens  # n × the prompt
    assert delta["vllm:generation_tokens_total"] == delta["vllm:request_generation_tokens_sum"] == usage.completion_tokens
    assert delta["vllm:iteration_tokens_total_sum"] == usage.total_tokens
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert delta[f"vllm:{name}_count"] == 2, name
    assert (delta["vllm:request_params_n_sum"], delta["vllm:request_params_n_count"]) == (2, 1)
    assert delta["vllm:request_max_num_generation_tokens_sum"] == usage.completion_tokens / 2  # greedy: equal choices
    for reason in ("stop", "length"):
        moved = sum(scrape(server, "vllm:request_success_total", finished_reason=reason)) - reasons_before[reason]
        assert moved == sum(c.finish_reason == reason for c in per_choice), reason
    # a Prometheus 2 scrape asks for OpenMetrics first: it still gets the text format, names intact
    wait_idle(server)
    r = httpx.get(server.url + "/metrics", headers={"Accept": "application/openmetrics-text;version=1.0.0,"
                                                              "text/plain;version=0.0.4;q=0.5"}, timeout=10)
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert samples(r.text, "vllm:kv_cache_usage_perc", model_name="tiny", engine="0") == [0.0]


def test_a_dead_worker_fails_health_and_in_flight_requests(servers):
    server = servers["deepseek_v2"]
    pids = server.worker_pids()
    assert len(pids) == 2
    body = {"model": "tiny", "prompt": "x", "max_tokens": 200, "temperature": 0, "stream": True}
    started = None
    lines = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            lines.append(line)
            if started is None and line.startswith("data: {"):
                os.kill(pids[1], signal.SIGKILL)
                started = time.monotonic()
    assert started is not None and time.monotonic() - started < 30
    assert any('"error"' in line for line in lines) and "data: [DONE]" not in lines
    server.wait_down()
