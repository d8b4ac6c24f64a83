"""``peer_vllm.py``'s load in process: ``vllm bench serve``'s closed loop on the engine, no
server, every step's work counted.

The load per point is ``vllm bench serve``'s with ``--dataset-name random --request-rate inf
--max-concurrency c --num-prompts 4c --num-warmups c --ignore-eos``: first ``c`` warm-up copies
of the point's first prompt, then ``4 · c`` requests of ``--prompt`` tokens and exactly ``--new``
new tokens, ``c`` in flight, the next one added as soon as one finishes (before the next step;
the server adds arrivals between steps too). Prompt ``i`` is vLLM's random-dataset prompt,
``(offset_i + i + arange(prompt)) mod vocab`` with ``offset = default_rng(seed).integers(0, vocab,
4c)``, so with one seed the first prompts of a larger point are a smaller point's prompts, as in
``peer_vllm.py`` (one seed for every point). Points run one after another on the same engine, as
they do on one server, so a prompt cached by an earlier point can hit.

The engine is configured as ``dcpgraph serve`` configures it for ``peer_vllm.py``: 2,048 batched
tokens, ``--max-num-seqs 16``, prefix caching on, max_model_len ``prompt + new + 64``, and a KV
cache sized as serve's default rule sizes ``--kv-gib`` per rank (``kv_cache_space_bytes``), or
(``--kv capped``) every sequence slot at ``max_model_len`` (what that rule gave before it kept the
whole space under prefix caching).
``--kv capped space`` runs one engine of each on the same weights, their points interleaved.

Per point: output tokens per second of wall time (warm-up excluded), mean TTFT (added → first
token), mean and median TPOT ((last − first token) ÷ (tokens − 1)), as ``vllm bench serve``
computes them; and the deterministic work: prompt tokens the engine computed (prefix-cache hits
excluded), steps, steps with a prefill chunk and their seconds, decode-only steps and theirs.

    python benchmarks/closed_loop.py --concurrency 8 16 --kv capped space
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from decode_profile import PEER, SHAPE  # noqa: E402
from decode_step import build_model  # noqa: E402

import dcpgraph  # noqa: E402

GIB = 1 << 30


def engine_for(program, args, kv: str):
    max_model_len = args.prompt + args.new + 64
    size = ({"kv_cache_tokens": max_model_len * args.max_num_seqs} if kv == "capped"
            else {"kv_cache_space_bytes": int(args.kv_gib * GIB)})
    return dcpgraph.compile(program, backend="eager", max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048,
                            max_model_len=max_model_len, enable_prefix_caching=True, **size)


def vllm_random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """vLLM's random dataset (no prefix, range ratio 0) for a tokenizer that round-trips its ids."""
    rng = np.random.default_rng(seed)
    rng.integers(length, length + 1, size=count)  # input lengths, drawn first
    rng.integers(1, 2, size=count)  # output lengths
    offsets = rng.integers(0, vocab, size=count)
    return [((offset + i + np.arange(length)) % vocab).tolist() for i, offset in enumerate(offsets)]


def run_point(engine, concurrency: int, args) -> dict:
    vocab = engine.program.facts.vocab_size
    pending = vllm_random_prompts(4 * concurrency, args.prompt, vocab, args.seed)
    for _ in range(concurrency):  # vllm bench serve's warm-up: the first prompt, c at once
        engine.add_request(pending[0], max_new_tokens=args.new, ignore_eos=True)
    while engine.scheduler.has_work():
        engine.step()
    plans = []
    schedule = engine.scheduler.schedule

    def recorded():
        plan = schedule()
        plans.append(sum(len(item.chunk.tokens) for item in plan if not (
            len(item.chunk.tokens) == 1 and item.request.computed + 1 == item.request.num_tokens)))
        return plan

    engine.scheduler.schedule = recorded
    added, first, last, count = {}, {}, {}, {}
    work = {"prompt_tokens": -engine.scheduler.prompt_tokens_computed, "steps": 0, "prefill_steps": 0,
            "prefill_s": 0.0, "decode_steps": 0, "decode_s": 0.0}

    def add() -> None:
        rid = engine.add_request(pending.pop(0), max_new_tokens=args.new, ignore_eos=True)
        added[rid] = time.perf_counter()
        count[rid] = 0

    for _ in range(concurrency):
        add()
    start = time.perf_counter()
    while engine.scheduler.has_work():
        t0 = time.perf_counter()
        events = engine.step()
        now = time.perf_counter()
        kind = "prefill" if plans[-1] else "decode"
        work["steps"] += 1
        work[f"{kind}_steps"] += 1
        work[f"{kind}_s"] += now - t0
        for rid, _token, done in events:
            count[rid] += 1
            first.setdefault(rid, now)
            last[rid] = now
            if done and pending:
                add()
    wall = time.perf_counter() - start
    del engine.scheduler.schedule
    work["prompt_tokens"] += engine.scheduler.prompt_tokens_computed
    ttft = [first[r] - added[r] for r in added]
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in added]
    return {"tok_s": sum(count.values()) / wall, "ttft_ms": 1e3 * statistics.mean(ttft),
            "tpot_ms": 1e3 * statistics.mean(tpot), "tpot_median_ms": 1e3 * statistics.median(tpot),
            "wall_s": wall, **work}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 16])
    p.add_argument("--shape", choices=["quick", "peer"], default="peer")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv", nargs="+", choices=["capped", "space"], default=["space"])
    p.add_argument("--kv-gib", type=float, default=2.0, help="the KV space per rank (peer_vllm.py gives vLLM 2 GiB)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    program = dcpgraph.trace(build_model(PEER if args.shape == "peer" else SHAPE, torch.float32))
    engines = {kv: engine_for(program, args, kv) for kv in args.kv}
    for kv, engine in engines.items():
        print(f"kv={kv}: {engine.blocks.num_blocks} blocks ({engine.blocks.capacity_tokens} tokens)", flush=True)
    for c in args.concurrency:
        for kv, engine in engines.items():
            with open("/proc/loadavg") as f:
                load = f.read().split()[0]
            r = run_point(engine, c, args)
            print(f"c={c} kv={kv} load={load}: " + ", ".join(
                f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    main()
