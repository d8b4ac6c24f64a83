"""Two "nodes" on 127.0.0.1: ``dcpgraph serve --nnodes 2`` as two process trees.

The head (``--node-rank 0``) runs the server and ranks 0–1; a second ``dcpgraph serve --headless
--node-rank 1`` process runs ranks 2–3. They meet at ``--master-addr 127.0.0.1 --master-port P``
(the gloo rendezvous) and the head's worker listener on ``P + 1``, exactly as two machines would.
Checked with the ``openai`` client against HF ``generate(do_sample=False)`` (fp64): GQA (Qwen3, one
KV head) at tp=4 / dcp=2 and MLA (DeepSeek-V2) at tp=4 / dcp=4. Then the headless node is killed
(SIGKILL to its process and its workers): the head's ``/health`` must fail and a request must end
with a 5xx, both within 60 s, and the head must still stop cleanly.

Data parallelism across the two nodes: ``-dp 2`` puts one whole replica on each (tp=1, so the
head sees the other node only through that replica's rank 0), for a dense Qwen3 and for a
Qwen3-MoE with ``--enable-expert-parallel`` (the experts partitioned over both nodes): concurrent
requests land on both replicas and equal HF, and losing the headless node fails the head's
``/health`` within 60 s.

Slow tier: five processes compile the model on two cores (~1–2 min per case).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from dcpgraph.checkpoints.model_dir import load_model, load_tokenizer
from dcpgraph.runtime.ports import free_port
from dcpgraph.testing.checkpoints import save_tiny_checkpoint
from dcpgraph.testing.generation import hf_greedy
from dcpgraph.testing.server import running_server

pytestmark = [pytest.mark.gloo, pytest.mark.slow]
COMMON = ("--dtype", "float64", "--block-size", "4", "--max-model-len", "128", "--max-num-seqs", "4")
MESHES = {"qwen3": ("-tp", "4", "-dcp", "2"), "deepseek_v2": ("-tp", "4", "-dcp", "4")}
PROMPTS = ["The future of AI is", "héllo wörld"]
MAX_TOKENS = 12


def free_port_pair(count: int = 2) -> int:
    """A port P with P + 1, ..., P + count - 1 free too (the rendezvous and the head's worker
    listeners: one, or one per data-parallel replica)."""
    for _ in range(50):
        port = free_port("127.0.0.1")
        with contextlib.suppress(OSError):
            with contextlib.ExitStack() as held:
                for extra in range(1, count):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port + extra))
            return port
    raise RuntimeError(f"no {count} consecutive free ports")


@contextlib.contextmanager
def headless_node(model: str, args: tuple[str, ...], log_path: str):
    command = [sys.executable, "-m", "dcpgraph", "serve", model, *args, "--headless", "--node-rank", "1"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        for pid in [process.pid, *worker_pids(log_path)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait(10)


def worker_pids(log_path: str) -> list[int]:
    with open(log_path, errors="replace") as f:
        match = re.search(r"worker pids \[([\d, ]+)\]", f.read())
    return [int(p) for p in match.group(1).split(",")] if match else []


@pytest.mark.parametrize("arch", list(MESHES))
def test_two_nodes_serve_hf_greedy_and_a_lost_node_fails_the_head(arch, checkpoints, tmp_path):
    model = checkpoints[arch]
    port = free_port_pair()
    nodes = ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port))
    args = (*MESHES[arch], *COMMON, *nodes)
    hf, tokenizer = load_model(model, "float64"), load_tokenizer(model)
    with headless_node(model, args, str(tmp_path / "node1.log")) as node1, \
            running_server(model, *args, "--node-rank", "0", log_path=str(tmp_path / "head.log")) as head:
        api = openai.OpenAI(base_url=head.url + "/v1", api_key="x", max_retries=0, timeout=120)
        for prompt in PROMPTS:
            out = api.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            ids = tokenizer(prompt)["input_ids"]
            assert out.choices[0].text == tokenizer.decode(hf_greedy(hf, ids, MAX_TOKENS), skip_special_tokens=True)
        assert len(head.worker_pids()) == 4 and worker_pids(str(tmp_path / "node1.log"))
        for pid in [node1.pid, *worker_pids(str(tmp_path / "node1.log"))]:  # the machine goes away
            os.kill(pid, signal.SIGKILL)
        lost = time.monotonic()
        while httpx.get(head.url + "/health", timeout=5).status_code == 200:
            assert time.monotonic() - lost < 60, "the head still reports healthy a minute after losing a node"
            time.sleep(0.5)
        r = httpx.post(head.url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4},
                       timeout=60)
        assert r.status_code >= 500 and time.monotonic() - lost < 60, r.text
    assert head.process.returncode is not None  # stopped by the fixture, not left running


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_two_nodes_each_running_a_whole_data_parallel_replica(arch, checkpoints, tmp_path):
    """qwen3: independent replicas; qwen3_moe with --enable-expert-parallel: the replicas' routed
    experts partitioned over both nodes (the EP group meets at the head's master port)."""
    if arch == "qwen3":
        model, extra = checkpoints["qwen3"], ()
    else:
        model, extra = save_tiny_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe"), ("--enable-expert-parallel",)
    port = free_port_pair(3)  # the EP group's store and the two replicas' listeners
    args = ("-dp", "2", *extra, *COMMON, "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port))
    hf, tokenizer = load_model(model, "float64"), load_tokenizer(model)
    node1_log = str(tmp_path / "node1.log")
    with headless_node(model, args, node1_log) as node1, \
            running_server(model, *args, "--node-rank", "0", log_path=str(tmp_path / "head.log")) as head:
        api = openai.OpenAI(base_url=head.url + "/v1", api_key="x", max_retries=0, timeout=120)
        prompts = ["The future of AI is", "héllo wörld", "one two three", "zzz"]
        with ThreadPoolExecutor(len(prompts)) as pool:  # at once: the router spreads them over both replicas
            outs = list(pool.map(lambda p: api.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS,
                                                                   temperature=0), prompts))
        for prompt, out in zip(prompts, outs):
            ids = tokenizer(prompt)["input_ids"]
            assert out.choices[0].text == tokenizer.decode(hf_greedy(hf, ids, MAX_TOKENS), skip_special_tokens=True)
        served = re.findall(r'vllm:request_success_total\{[^}]*engine="(\d)"[^}]*\} (\d+)',
                            httpx.get(head.url + "/metrics", timeout=10).text)
        per_engine = {}
        for engine, count in served:
            per_engine[engine] = per_engine.get(engine, 0) + int(count)
        assert per_engine.get("0", 0) > 0 and per_engine.get("1", 0) > 0, served
        for pid in [node1.pid, *worker_pids(node1_log)]:  # the machine goes away
            os.kill(pid, signal.SIGKILL)
        lost = time.monotonic()
        while httpx.get(head.url + "/health", timeout=5).status_code == 200:
            assert time.monotonic() - lost < 60, "the head still reports healthy a minute after losing a node"
            time.sleep(0.5)
    assert head.process.returncode is not None
