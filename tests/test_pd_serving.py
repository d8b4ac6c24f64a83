"""P/D disaggregation across processes, end to end on 127.0.0.1 with the ``openai`` client:
``dcpgraph serve --kv-transfer-config`` producers and a consumer behind ``dcpgraph proxy``.

Per checkpoint (GQA Qwen3, MLA DeepSeek-V2): producers at tp=2/dcp=1 and tp=1 (taken round robin,
so every prompt goes through both pairs) hand over to one consumer at tp=2/dcp=2 (row re-shard for
GQA, whole blocks with ``interleave == block_size`` for MLA). Reference: HF ``generate`` greedy on
the same checkpoint. Every server is started and stopped by its fixture; every loop is bounded.
"""

from __future__ import annotations

import openai
import pytest

from dcpgraph.checkpoints.model_dir import load_model, load_tokenizer
from dcpgraph.testing.generation import hf_greedy
from dcpgraph.testing.pd import SERVE_ARGS, kv_config, wait_kv_free
from dcpgraph.testing.pd import kv_stats as stats
from dcpgraph.testing.server import free_port, running_dcpgraph, running_server

pytestmark = [pytest.mark.gloo, pytest.mark.slow]
SHORT = "x"  # one token: shorter than a block
MEDIUM = "The future of AI is"
LONG = "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9 " * 2  # 144 tokens, 36 blocks
SHARED = "Once upon a time, in a land far away, there lived a "
COMMON = SERVE_ARGS


@pytest.fixture(scope="module")
def reference(checkpoints):
    cache = {arch: (load_model(path, "float64"), load_tokenizer(path)) for arch, path in checkpoints.items()}

    def text(arch, ids, max_tokens):
        model, tokenizer = cache[arch]
        return tokenizer.decode(hf_greedy(model, ids, max_tokens), skip_special_tokens=True)

    def transfers(arch, ids) -> int:
        """1 if the request's KV crosses to the consumer: not when its first token is the EOS
        (the producer finishes it, and nothing is left to decode)."""
        model, tokenizer = cache[arch]
        return int(hf_greedy(model, ids, 1) != [tokenizer.eos_token_id])

    text.tokenizer = lambda arch: cache[arch][1]
    text.transfers = transfers
    return text


@pytest.fixture(scope="module", params=["qwen3", "deepseek_v2"])
def deployment(request, checkpoints, tmp_path_factory):
    arch = request.param
    logs = tmp_path_factory.mktemp(f"logs-{arch}")
    port = free_port()
    interleave = "4" if arch == "deepseek_v2" else "1"  # whole blocks (MLA) / row re-shard (GQA)
    model = checkpoints[arch]
    with running_server(model, *COMMON, "-tp", "2", "--kv-transfer-config", kv_config("kv_producer", 0, 3, port),
                        log_path=str(logs / "p_tp2.log")) as p2, \
            running_server(model, *COMMON, "-tp", "1", "--kv-transfer-config", kv_config("kv_producer", 1, 3, port),
                           log_path=str(logs / "p_tp1.log")) as p1, \
            running_server(model, *COMMON, "-tp", "2", "-dcp", "2", "--cp-kv-cache-interleave-size", interleave,
                           "--kv-transfer-config", kv_config("kv_consumer", 2, 3, port),
                           log_path=str(logs / "d.log")) as d, \
            running_dcpgraph("proxy", "--prefill", p2.url, "--prefill", p1.url, "--decode", d.url,
                             log_path=str(logs / "proxy.log")) as proxy:
        yield arch, {"p_tp2": p2, "p_tp1": p1, "d": d, "proxy": proxy}


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_greedy_text_through_the_proxy_equals_hf(deployment, reference):
    arch, servers = deployment
    tok, api = reference.tokenizer(arch), client(servers["proxy"])
    expected = 0  # requests whose KV crosses to the consumer
    for prompt in (SHORT, MEDIUM, LONG):
        want = reference(arch, tok.encode(prompt), 12)
        expected += 4 * reference.transfers(arch, tok.encode(prompt))  # 2 producers x (whole, streamed)
        for _ in range(2):  # round robin: once through each producer (tp=2 and tp=1)
            got = api.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
            assert got.choices[0].text == want, (arch, prompt)
            assert got.usage.prompt_tokens == len(tok.encode(prompt))
            chunks = list(api.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                                 stream=True))
            assert "".join(c.choices[0].text for c in chunks) == want
    messages = [{"role": "user", "content": "héllo"}]
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    chat = api.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == reference(arch, ids, 10)
    expected += reference.transfers(arch, ids)
    wait_kv_free(servers["p_tp2"], servers["p_tp1"], servers["d"])
    consumer = stats(servers["d"])
    assert expected >= 9 and consumer["transfers_received"] >= expected and consumer["failures"] == 0
    assert consumer["prompt_tokens_computed"] == 0  # the consumer never recomputed a prompt token
    assert stats(servers["p_tp2"])["transfers_sent"] > 0 and stats(servers["p_tp1"])["transfers_sent"] > 0


def test_shared_prefix_hits_the_consumer_cache(deployment, reference):
    arch, servers = deployment
    tok, api = reference.tokenizer(arch), client(servers["proxy"])
    before = stats(servers["d"])
    for tail in ("princess.", "dragon who"):
        prompt = SHARED + tail
        got = api.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        assert got.choices[0].text == reference(arch, tok.encode(prompt), 8)
    after = stats(servers["d"])
    assert after["tokens_from_prefix_cache"] - before["tokens_from_prefix_cache"] >= 32  # the shared blocks
    assert after["prompt_tokens_computed"] == 0
    wait_kv_free(servers["p_tp2"], servers["p_tp1"], servers["d"])


def test_concurrent_streams_through_the_proxy(deployment, reference):
    """Eight streams at once (both producers, one consumer taking them in turn): HF's text each."""
    import asyncio
    import json

    import httpx

    arch, servers = deployment
    tok = reference.tokenizer(arch)
    prompts = [f"{i} {MEDIUM}" * (1 + i % 3) for i in range(8)]
    want = [reference(arch, tok.encode(p), 6) for p in prompts]

    async def one(http, prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True}
        text = ""
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    data = json.loads(line[6:])
                    assert "error" not in data, data
                    text += data["choices"][0]["text"]
        return text

    async def run():
        async with httpx.AsyncClient(base_url=servers["proxy"].url, timeout=120) as http:
            return await asyncio.gather(*(one(http, p) for p in prompts))

    assert asyncio.run(asyncio.wait_for(run(), 300)) == want
    wait_kv_free(servers["p_tp2"], servers["p_tp1"], servers["d"])
    assert stats(servers["d"])["prompt_tokens_computed"] == 0
