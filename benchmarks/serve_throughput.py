"""Serving benchmark, like ``vllm bench serve``: N concurrent streaming clients against
``dcpgraph serve``, then the offline ``LLM`` on the same requests.

    python benchmarks/serve_throughput.py                     # tiny Qwen3 checkpoint, tp=2 dcp=2
    python benchmarks/serve_throughput.py --quick             # fewer, shorter requests
    python benchmarks/serve_throughput.py --model DIR -tp 2 -dcp 2 --clients 16 --requests 64

Requests have mixed prompt lengths (``--prompt-len`` range, characters of a byte-level tokenizer)
and output lengths (``--output-len`` range), drawn from a fixed seed, greedy. Each client sends
its next request as soon as the last one ends (at most ``--clients`` in flight). Measured per
request: TTFT (request sent → first streamed token) and TPOT ((last − first token time) /
(tokens − 1)); overall: generated tokens per second of wall time. Then the same requests run on an
offline :class:`dcpgraph.LLM` of the same configuration (the server is stopped first, so the two
never share the CPUs); the ratio server/offline is the serving overhead. Both first run a warm-up
batch of ``--clients`` short requests (the first step at each batch size compiles its graph). Records go to
``benchmarks/results/serve_throughput.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time

from common import load_note, print_records, record, stop_servers_on_sigterm, write

from dcpgraph import LLM, SamplingParams
from dcpgraph.testing.checkpoints import save_tiny_checkpoint
from dcpgraph.testing.server import running_server


def percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    if not xs:
        return {}
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": sum(xs) / len(xs)}


def make_requests(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    words = ["the", "future", "of", "decode", "context", "parallel", "cache", "héllo", "wörld", "rank"]
    out = []
    for _ in range(n):
        target = rng.randint(*prompt_len)
        text = ""
        while len(text) < target:
            text += rng.choice(words) + " "
        out.append((text[:target], rng.randint(*output_len)))
    return out


async def client_load(url: str, requests: list[tuple[str, int]], clients: int) -> tuple[list[dict], float]:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for item in requests:
        queue.put_nowait(item)
    results: list[dict] = []

    async def client(http):
        while not queue.empty():
            prompt, max_tokens = queue.get_nowait()
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            sent, first, last, tokens = time.perf_counter(), None, None, 0
            async with http.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    data = json.loads(line[6:])
                    if data.get("usage"):
                        tokens = data["usage"]["completion_tokens"]
                    elif data["choices"]:
                        now = time.perf_counter()
                        first = first or now
                        last = now
            results.append({"ttft": first - sent, "tpot": (last - first) / (tokens - 1) if tokens > 1 else None,
                            "tokens": tokens})

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        return results, time.perf_counter() - start


def main() -> None:
    stop_servers_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: a tiny random Qwen3 checkpoint)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=2)
    p.add_argument("-dcp", "--decode-context-parallel-size", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(8, 120))
    p.add_argument("--output-len", type=int, nargs=2, default=(8, 64))
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda", "npu"], help="where the ranks run")
    args = p.parse_args()
    if args.quick:
        args.requests, args.clients, args.output_len = 16, 8, (4, 24)
    tmp = tempfile.TemporaryDirectory()
    model = args.model or save_tiny_checkpoint(f"{tmp.name}/qwen3", "qwen3")
    requests = make_requests(args.requests, tuple(args.prompt_len), tuple(args.output_len), args.seed)
    flags = ["-tp", str(args.tensor_parallel_size), "-dcp", str(args.decode_context_parallel_size),
             "--block-size", str(args.block_size), "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
             "--served-model-name", "bench", "--device", args.device]
    warmup = [(prompt, 4) for prompt, _ in requests[: args.clients]]  # first use of each batch size compiles
    with running_server(model, *flags, log_path=f"{tmp.name}/server.log") as server:
        asyncio.run(client_load(server.url, warmup, args.clients))
        results, wall = asyncio.run(client_load(server.url, requests, args.clients))
    tokens = sum(r["tokens"] for r in results)
    config = (f"tp={args.tensor_parallel_size} dcp={args.decode_context_parallel_size} device={args.device} "
              f"clients={args.clients} "
              f"requests={args.requests} {args.dtype} {load_note()}")
    records = [record("serve_throughput", config, f"ttft_{k}", v, "s") for k, v in
               percentiles([r["ttft"] for r in results]).items()]
    records += [record("serve_throughput", config, f"tpot_{k}", v, "s") for k, v in
                percentiles([r["tpot"] for r in results if r["tpot"] is not None]).items()]

    llm = LLM(model=model, tensor_parallel_size=args.tensor_parallel_size,
              decode_context_parallel_size=args.decode_context_parallel_size, block_size=args.block_size,
              dtype=args.dtype, max_num_seqs=args.max_num_seqs, device=args.device)
    try:
        llm.generate([p for p, _ in warmup], SamplingParams(temperature=0, max_tokens=4))
        start = time.perf_counter()
        outputs = llm.generate([r[0] for r in requests], [SamplingParams(temperature=0, max_tokens=n) for _, n in requests])
        offline_wall = time.perf_counter() - start
    finally:
        llm.shutdown()
    offline_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    server_tps, offline_tps = tokens / wall, offline_tokens / offline_wall
    records.append(record("serve_throughput", config, "server_output_tokens_per_s", server_tps, "tok/s",
                          baseline=offline_tps, generated_tokens=tokens, wall_s=wall))
    records.append(record("serve_throughput", config, "offline_output_tokens_per_s", offline_tps, "tok/s",
                          generated_tokens=offline_tokens, wall_s=offline_wall))
    print_records(records)
    print(f"wrote {write('serve_throughput', records)}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
