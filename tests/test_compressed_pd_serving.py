"""DeepSeek-V4 P/D between serving instances, end to end on 127.0.0.1 with the ``openai`` client:
a ``dcpgraph serve`` producer at tp1 (blocks of 4) hands each request over to a consumer at
tp2·dcp2 (blocks of 8, interleave 2: entries dealt in runs of 2 per rank) behind ``dcpgraph
proxy``. The raw window travels by token position, the compressed entries and CSA's indexer keys
by entry index, the open windows as state whole on every rank
(:mod:`dcpgraph.serving.kv_connector.plan`). The last prompt shares a virtual block (16 tokens)
with the one before, so the consumer's own prefix cache holds its first block and only the
entries after it travel. Reference: HF ``generate`` greedy on the same tiny V4 weights, as text."""

from __future__ import annotations

import dsv4_models
import openai
import pytest

from dcpgraph.testing.checkpoints import tiny_tokenizer
from dcpgraph.testing.generation import hf_greedy
from dcpgraph.testing.pd import kv_config, wait_kv_free
from dcpgraph.testing.pd import kv_stats as stats
from dcpgraph.testing.server import free_port, running_dcpgraph, running_servers

pytestmark = [pytest.mark.gloo, pytest.mark.slow]  # three servers (a tp2 one: two workers), each traces V4
VOCAB = 96  # the character tokenizer's largest size, so every generated id decodes to a character
SERVE = ("--dtype", "float64", "--max-model-len", "64", "--max-num-seqs", "4", "--served-model-name", "tiny")
BASE = "THE QUICK BROWN FOX JUMPS"  # 25 tokens: past the window (6) and many entries (rates 2 and 4)
PROMPTS = ["ABC", "HELLO WORLD", BASE, BASE[:18] + "OVER IT"]  # the last shares 16 tokens with BASE
NEW = 6


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4-pd")
    model = dsv4_models.build(vocab_size=VOCAB)
    tokenizer = tiny_tokenizer(VOCAB)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    want = {p: tokenizer.decode(hf_greedy(model, tokenizer.encode(p), NEW), skip_special_tokens=True)
            for p in PROMPTS}
    path, port = str(root / "model"), free_port()
    producer = ((path, *SERVE, "--block-size", "4", "--kv-transfer-config", kv_config("kv_producer", 0, 2, port)),
                str(root / "producer.log"))
    consumer = ((path, *SERVE, "-tp", "2", "-dcp", "2", "--block-size", "8", "--cp-kv-cache-interleave-size", "2",
                 "--kv-transfer-config", kv_config("kv_consumer", 1, 2, port)), str(root / "consumer.log"))
    with running_servers(producer, consumer) as (p, c), \
            running_dcpgraph("proxy", "--prefill", p.url, "--decode", c.url, log_path=str(root / "proxy.log")) as proxy:
        yield want, p, c, proxy


def test_v4_greedy_text_through_the_proxy_equals_hf(deployment):
    want, producer, consumer, proxy = deployment
    api = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    for prompt in PROMPTS:
        got = api.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0,
                                     extra_body={"ignore_eos": True})
        assert got.choices[0].text == want[prompt], prompt
    wait_kv_free(producer, consumer)
    received = stats(consumer)
    assert received["transfers_received"] == len(PROMPTS) and received["failures"] == 0
    assert received["prompt_tokens_computed"] == 0  # nothing received was recomputed
    assert received["tokens_from_prefix_cache"] == 16  # the last prompt's first virtual block, on the consumer
    assert stats(producer)["transfers_sent"] == len(PROMPTS)
