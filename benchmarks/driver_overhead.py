"""Per-step cost of driving worker processes, and a ~160M bf16 model's batch-8 decode step.

    python3 benchmarks/driver_overhead.py [--quick] [--baseline DIR]

Served by ``LLM`` with one worker process per rank (gloo, dcp = 2), 8 running requests, every
decode step timed by the front end (``RemoteEngine.step()``). Rank 0 reports its own step time
and, of it, the time it spent broadcasting the step's packed inputs to the other ranks. The
link's cost per step is ``front-end step − rank-0 step + broadcast``: the call to rank 0 and its
reply, plus the broadcast.

- ``tiny``: the tiny Qwen3 test checkpoint (fp32) at tp = 2 and 4: the step is almost all link.
- ``160m``: a Qwen3-shaped model of ~160M parameters (hidden 768, 12 layers, one KV head, vocab 50,304) in
  bf16 at tp = 2: a step with real compute.

``--baseline DIR`` runs the same measurement on another checkout (``PYTHONPATH=DIR``, e.g. the
commit before the driver/follower split, whose ranks each ran the whole engine and answered every
call) in a subprocess, and prints each figure's ratio to it. An older checkout that reports one
step time per rank and no broadcast is measured as ``front-end step − slowest rank's step``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SIZES = {"tiny": (2, 4), "160m": (2,)}


def save_160m(path: str) -> str:
    """A random-weight Qwen3 checkpoint of ~160M parameters, bf16, with the tiny test tokenizer."""
    import torch
    import transformers as tf

    from dcpgraph.testing.checkpoints import first_special_id, tiny_tokenizer

    special = first_special_id(321)
    config = tf.Qwen3Config(hidden_size=768, num_hidden_layers=12, intermediate_size=2560, num_attention_heads=12,
                            num_key_value_heads=1, head_dim=64, vocab_size=50304, max_position_embeddings=4096,
                            bos_token_id=special, eos_token_id=special + 2, pad_token_id=special,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.save_pretrained(path)
    tiny_tokenizer(321).save_pretrained(path)
    return path


def measure(path: str, tp: int, steps: int, dtype: str) -> dict:
    from dcpgraph import LLM

    with LLM(model=path, dtype=dtype, block_size=16, tensor_parallel_size=tp, decode_context_parallel_size=2,
             max_num_seqs=8, max_model_len=1024) as llm:
        engine = llm.engine
        for i in range(8):
            engine.add_request([5 + i, 9, 4, 77], steps + 4)
        front, rank, link = [], [], []
        engine.step()  # the prefill
        for _ in range(steps):
            start = time.perf_counter()
            events = engine.step()
            elapsed = time.perf_counter() - start
            if len(events) < 8:  # a request ended (EOS): the batch is no longer 8
                break
            own = engine.last_step_rank_seconds
            broadcast = getattr(engine, "last_step_broadcast_seconds", 0.0)
            front.append(elapsed)
            rank.append(max(own))
            link.append(elapsed - max(own) + broadcast)
    return {"steps": len(front), "front_ms": statistics.median(front) * 1e3,
            "rank_ms": statistics.median(rank) * 1e3, "link_us": statistics.median(link) * 1e6}


def measure_all(quick: bool) -> dict:
    steps = 20 if quick else 60
    out = {}
    with tempfile.TemporaryDirectory() as root:
        from dcpgraph.testing.checkpoints import save_tiny_checkpoint

        paths = {"tiny": (save_tiny_checkpoint(f"{root}/qwen3", "qwen3"), "float32"),
                 "160m": (save_160m(f"{root}/qwen3-160m"), "bfloat16")}
        for size, tps in SIZES.items():
            path, dtype = paths[size]
            for tp in tps:
                out[f"{size} tp={tp}"] = measure(path, tp, steps, dtype)
    return out


def run_baseline(directory: str, quick: bool) -> dict:
    """This script's measurement on the checkout at ``directory``, in a subprocess run from that
    directory (the worker processes' fork server puts its working directory first on ``sys.path``)."""
    directory = os.path.abspath(directory)
    cmd = [sys.executable, os.path.abspath(__file__), "--json"] + (["--quick"] if quick else [])
    done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": directory}, cwd=directory, capture_output=True,
                          text=True)
    if done.returncode:
        raise RuntimeError(f"the baseline run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20 decode steps instead of 60")
    parser.add_argument("--baseline", help="another checkout to measure the same way, for ratios")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # the baseline's output
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if args.json:
        print(json.dumps(measure_all(args.quick)))
        return 0
    from common import load_note, record, write

    base = run_baseline(args.baseline, args.quick) if args.baseline else {}
    now = measure_all(args.quick)
    records = []
    for name, m in now.items():
        config = f"qwen3 {name} dcp=2, batch 8 decode, {m['steps']} steps, {load_note()}"
        line = (f"{name}: front-end step {m['front_ms']:.2f} ms, rank-0 step {m['rank_ms']:.2f} ms, "
                f"link {m['link_us']:.0f} us a step")
        b = base.get(name)
        if b:
            line += (f" | baseline: front-end {b['front_ms']:.2f} ms, link {b['link_us']:.0f} us; "
                     f"ratio front-end {m['front_ms'] / b['front_ms']:.2f}, link {m['link_us'] / b['link_us']:.2f}")
        print(line)
        records += [record("driver_overhead", config, "front_end_step_ms", m["front_ms"], "ms",
                           baseline=b["front_ms"] if b else None),
                    record("driver_overhead", config, "link_per_step_us", m["link_us"], "us",
                           baseline=b["link_us"] if b else None)]
    print(f"wrote {write('driver_overhead', records)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
