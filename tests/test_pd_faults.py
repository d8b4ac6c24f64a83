"""P/D faults across processes (tp=1 instances, GQA checkpoint): a consumer that dies mid-transfer,
a producer that dies after accepting a request, a transfer nobody completes. Each ends with a
clear error at the proxy (or the instance), no hang (every wait is bounded by the 4 s transfer and
hold timeouts), KV usage back to zero on the surviving instances, and the next request succeeding.
Faults are injected with ``DCPGRAPH_KV_FAULT`` (see ``serving/kv_connector/rank_ops.py``)."""

from __future__ import annotations

import time

import httpx
import pytest

from dcpgraph.checkpoints.model_dir import load_model, load_tokenizer
from dcpgraph.testing.checkpoints import save_tiny_checkpoint
from dcpgraph.testing.generation import hf_greedy
from dcpgraph.testing.pd import SERVE_ARGS as COMMON
from dcpgraph.testing.pd import kv_config, wait_kv_free
from dcpgraph.testing.pd import kv_stats as stats
from dcpgraph.testing.server import free_port, running_dcpgraph, running_server

pytestmark = [pytest.mark.gloo, pytest.mark.slow]
TIMEOUTS = {"transfer_timeout_s": 4, "hold_timeout_s": 4}
BODY = {"model": "tiny", "prompt": "The future of AI is", "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("pdf")
    model = save_tiny_checkpoint(root / "qwen3", "qwen3")
    port = free_port()

    def serve(name, role, rank, fault=None):
        env = {"DCPGRAPH_KV_FAULT": fault} if fault else None
        return running_server(model, *COMMON, "--kv-transfer-config", kv_config(role, rank, 4, port, **TIMEOUTS),
                              log_path=str(root / f"{name}.log"), env=env)

    with serve("p", "kv_producer", 0) as p, serve("d", "kv_consumer", 1) as d, \
            serve("p_dies", "kv_producer", 2, "producer_exit_before_send") as p_dies, \
            serve("d_dies", "kv_consumer", 3, "consumer_exit_mid_transfer") as d_dies, \
            running_dcpgraph("proxy", "--prefill", p.url, "--decode", d_dies.url, "--decode", d.url,
                             log_path=str(root / "proxy_a.log")) as proxy_a, \
            running_dcpgraph("proxy", "--prefill", p_dies.url, "--prefill", p.url, "--decode", d.url,
                             log_path=str(root / "proxy_b.log")) as proxy_b:
        tok = load_tokenizer(model)
        want = tok.decode(hf_greedy(load_model(model, "float64"), tok.encode(BODY["prompt"]), BODY["max_tokens"]),
                          skip_special_tokens=True)
        yield {"p": p, "d": d, "p_dies": p_dies, "d_dies": d_dies, "proxy_a": proxy_a, "proxy_b": proxy_b,
               "want": want}


def post(server, body=BODY, path="/v1/completions"):
    return httpx.post(server.url + path, json=body, timeout=60)


def test_consumer_dies_mid_transfer(cluster):
    began = time.monotonic()
    r = post(cluster["proxy_a"])  # round robin: the dying consumer first
    assert r.status_code == 502 and "decode instance" in r.json()["error"]["message"], r.text
    assert time.monotonic() - began < 30
    assert cluster["d_dies"].process.wait(10) == 17  # it really died, in the transfer
    wait_kv_free(cluster["p"])  # the producer freed the blocks it was sending
    assert stats(cluster["p"])["failures"] >= 1
    r = post(cluster["proxy_a"])  # the next request: the healthy consumer
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == cluster["want"]
    wait_kv_free(cluster["p"], cluster["d"])


def test_producer_dies_after_accepting(cluster):
    began = time.monotonic()
    r = post(cluster["proxy_b"])  # round robin: the dying producer first
    message = r.json()["error"]["message"]
    assert r.status_code == 503 and "KV transfer" in message and "timeout" in message, r.text
    assert time.monotonic() - began < 30
    assert cluster["p_dies"].process.wait(10) == 17
    wait_kv_free(cluster["d"])  # the consumer dropped the request it adopted
    r = post(cluster["proxy_b"])  # the next request: the healthy producer
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == cluster["want"]
    assert stats(cluster["d"])["prompt_tokens_computed"] == 0
    wait_kv_free(cluster["p"], cluster["d"])


def test_held_kv_nobody_asks_for_expires_and_the_consumer_is_told(cluster):
    p, d = cluster["p"], cluster["d"]
    r = post(p, {**BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200
    params = r.json()["kv_transfer_params"]
    assert stats(p)["held"] == 1
    deadline = time.monotonic() + 20
    while stats(p)["held"]:  # freed by hold_timeout_s (4 s)
        assert time.monotonic() < deadline, "the producer still holds the KV"
        time.sleep(0.25)
    assert stats(p)["expired"] >= 1
    wait_kv_free(p)
    r = post(d, {**BODY, "kv_transfer_params": params})  # too late: refused at once, not after a wait
    assert r.status_code == 503 and "no consumer asked" in r.json()["error"]["message"], r.text


def test_transfer_timeout_when_no_producer_joins(cluster):
    p, d = cluster["p"], cluster["d"]
    r = post(p, {**BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    params = {**r.json()["kv_transfer_params"], "transfer_id": "0-nobody-holds-this"}
    began = time.monotonic()
    r = post(d, {**BODY, "kv_transfer_params": params})
    assert r.status_code == 503 and "timeout 4 s" in r.json()["error"]["message"], r.text
    assert 3 < time.monotonic() - began < 30
    wait_kv_free(p, d, timeout_s=20)
    r = post(cluster["proxy_b"])  # both keep serving
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == cluster["want"]
