"""Hybrid models through ``dcpgraph serve`` at tp > 1, and P/D between two serve instances with the
recurrent state travelling with the KV through the kv_connector: a producer at tp2·dcp1 hands over
to a consumer at tp2·dcp2 behind ``dcpgraph proxy``. Checkpoints: the tiny qwen3_next (gated delta
nets split over TP) and bamba (Mamba-2, 4 B/C groups) of ``hybrid_models``, saved with a
character tokenizer. Reference: HF ``generate`` greedy on the same weights, compared as text
through the ``openai`` client. Every server is started and stopped by its fixture."""

from __future__ import annotations

import openai
import pytest
from hybrid_models import MAMBA2_MESH_MODELS, MESH_MODELS

from dcpgraph.testing.checkpoints import tiny_tokenizer
from dcpgraph.testing.generation import hf_greedy
from dcpgraph.testing.pd import kv_config, wait_kv_free
from dcpgraph.testing.pd import kv_stats as stats
from dcpgraph.testing.server import free_port, running_dcpgraph, running_server

pytestmark = [pytest.mark.gloo, pytest.mark.slow]  # three tp=2 servers (six worker processes) per model
BUILDERS = {"qwen3_next": MESH_MODELS["qwen3_next"], "bamba": MAMBA2_MESH_MODELS["bamba"]}
SERVE = ("--dtype", "float32", "--block-size", "4", "--max-model-len", "128", "--max-num-seqs", "4",
         "--served-model-name", "tiny", "-tp", "2")
PROMPTS = ["HELLO WORLD", "ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789", "X"]  # the character tokenizer's alphabet
NEW = 8


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def deployment(request, tmp_path_factory):
    name = request.param
    root = tmp_path_factory.mktemp(f"hybrid-{name}")
    model = BUILDERS[name]()
    tokenizer = tiny_tokenizer(model.config.vocab_size)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    want = {p: tokenizer.decode(hf_greedy(model, tokenizer.encode(p), NEW), skip_special_tokens=True) for p in PROMPTS}
    port, path = free_port(), str(root / "model")
    with running_server(path, *SERVE, "--kv-transfer-config", kv_config("kv_producer", 0, 2, port),
                        log_path=str(root / "producer.log")) as producer, \
            running_server(path, *SERVE, "-dcp", "2", "--kv-transfer-config", kv_config("kv_consumer", 1, 2, port),
                           log_path=str(root / "consumer.log")) as consumer, \
            running_dcpgraph("proxy", "--prefill", producer.url, "--decode", consumer.url,
                             log_path=str(root / "proxy.log")) as proxy:
        yield name, want, {"producer": producer, "consumer": consumer, "proxy": proxy}


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_serve_a_hybrid_at_tp2_dcp2_equals_hf(deployment):
    """The consumer alone is a plain tp2·dcp2 server of the hybrid checkpoint (a request without
    kv_transfer_params runs on it from its first token)."""
    name, want, servers = deployment
    api = client(servers["consumer"])
    for prompt in PROMPTS:
        got = api.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0)
        assert got.choices[0].text == want[prompt], (name, prompt)


def test_pd_moves_the_recurrent_state_with_the_kv(deployment):
    name, want, servers = deployment
    wait_kv_free(servers["producer"], servers["consumer"])  # the counters are read once both are idle (fresh)
    before = stats(servers["consumer"])
    api = client(servers["proxy"])
    for prompt in PROMPTS:
        got = api.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0)
        assert got.choices[0].text == want[prompt], (name, prompt)
    wait_kv_free(servers["producer"], servers["consumer"])
    after = stats(servers["consumer"])
    assert after["transfers_received"] - before["transfers_received"] == len(PROMPTS)
    assert after["failures"] == 0
    assert after["prompt_tokens_computed"] == before["prompt_tokens_computed"]  # nothing received was recomputed
    assert stats(servers["producer"])["transfers_sent"] >= len(PROMPTS)
