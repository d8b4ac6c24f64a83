"""dcpgraph against vLLM's CPU build on the same machine: the same checkpoint served by
``dcpgraph serve`` and then by ``vllm serve`` (one after the other, never both at once), each
driven by vLLM's own load client, ``vllm bench serve``, with the same load.

    python benchmarks/peer_vllm.py --quick                     # ~27M-parameter model, 2 points
    python benchmarks/peer_vllm.py                             # ~125M parameters, concurrency 1, 8
    python benchmarks/peer_vllm.py --model DIR --concurrency 1 4 8 16 --input-len 2048

The load: ``--dataset-name random`` prompts of exactly ``--input-len`` tokens, ``--output-len``
new tokens each with ``--ignore-eos``, ``--num-prompts`` per point (default 4 × concurrency, at
least 8), at most ``--concurrency`` in flight, sent as fast as allowed (``--request-rate inf``),
streamed through ``/v1/completions``; the same seeds, so both servers get the same prompts.
Before each point, ``concurrency`` warm-up requests (dcpgraph compiles a graph per batch size on
first use; vLLM warms up at start). Both servers run with their defaults except
``--max-num-seqs``, ``--max-model-len`` and the dtype; both servers' KV cache is
``VLLM_CPU_KVCACHE_SPACE`` (``--vllm-kv-gib``) per rank. Each point draws its prompts with its own
seed, ``--seed + concurrency``: with one seed a larger point's first prompts would be a smaller
point's (vLLM's random dataset draws its offsets in order) and hit the prefix cache wherever the
space still held them, so a point would measure cache retention as well as compute. Measured per point, as ``vllm bench serve``
computes them: output tokens per second (generated tokens ÷ the run's wall time), TTFT (request
sent → first streamed token) and TPOT ((latency − TTFT) ÷ (tokens − 1)), median and p99. Each
record's value is dcpgraph's, ``baseline`` vLLM's and ``ratio`` dcpgraph ÷ vLLM (above 1 is
better for throughput, below 1 for TTFT and TPOT).

vLLM comes from its own venv (``$DCPGRAPH_VLLM_VENV`` or /opt/vllm-venv; docs/testing.md has
the install command). Where it is absent or cannot start, the benchmark says why, records the
error (metric ``vllm_unavailable``) and still measures dcpgraph. Records go to
``benchmarks/results/peer_vllm.json`` (``peer_vllm_<dtype>.json`` for a dtype other than bf16).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import tempfile
import time
from pathlib import Path

from common import load_note, print_records, record, stop_servers_on_sigterm, write

from dcpgraph.testing.server import running_server
from dcpgraph.testing.vllm_bench import (
    ModelShape,
    bench_command,
    install_command,
    run_bench,
    running_vllm,
    save_word_checkpoint,
    vllm_cli,
    vllm_venv,
)

NAME = "peer_vllm"
SERVED = "peer"
FULL = ModelShape(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=32000)
QUICK = ModelShape(hidden=512, layers=4, heads=8, kv_heads=2, intermediate=1408, vocab=16000)
# (vllm bench serve's result key, our metric name, unit, scale)
METRICS = [("output_throughput", "output_tokens_per_s", "tok/s", 1.0),
           ("median_ttft_ms", "ttft_median", "ms", 1.0), ("p99_ttft_ms", "ttft_p99", "ms", 1.0),
           ("median_tpot_ms", "tpot_median", "ms", 1.0), ("p99_tpot_ms", "tpot_p99", "ms", 1.0),
           ("mean_ttft_ms", "ttft_mean", "ms", 1.0), ("mean_tpot_ms", "tpot_mean", "ms", 1.0)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory with head_dim 64 or 128 (default: a random "
                                                 "Qwen3 checkpoint written for the run)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=None, help="per point (default: 4 × concurrency, ≥ 8)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--vllm-kv-gib", type=float, default=2.0, help="VLLM_CPU_KVCACHE_SPACE, for both servers")
    p.add_argument("--vllm-omp-threads", type=int, default=None,
                   help="OMP_NUM_THREADS for vLLM (default: vLLM's own choice, which on 2 cores is 1 torch thread)")
    p.add_argument("--quick", action="store_true", help="a ~27M-parameter model, concurrency 1 and 4, "
                                                        "256-token prompts, 32 new tokens")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.concurrency, args.input_len, args.output_len = [1, 4], 256, 32
    return args


def num_prompts(args, concurrency: int) -> int:
    return args.num_prompts or max(8, 4 * concurrency)


def measure(server_url: str, model: str, args, root: Path, who: str) -> dict[int, dict]:
    """``vllm bench serve`` at each concurrency against one server: {concurrency: its JSON result}."""
    results = {}
    for c in args.concurrency:
        command = bench_command(server_url, model, SERVED, backend="openai", num_prompts=num_prompts(args, c),
                                input_len=args.input_len, output_len=args.output_len, concurrency=c,
                                result_dir=str(root), result_file=f"{who}-c{c}.json", seed=args.seed + c, warmups=c)
        start = time.perf_counter()
        results[c] = run_bench(command, str(root / f"{who}-c{c}.log"), timeout_s=1800)
        print(f"  {who} concurrency {c}: {results[c]['output_throughput']:.1f} output tok/s, "
              f"{results[c]['failed']} failed ({time.perf_counter() - start:.0f} s)", flush=True)
    return results


def server_flags(args) -> list[str]:
    """The flags both servers get (vLLM's names)."""
    return ["--served-model-name", SERVED, "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
            "--max-model-len", str(max_model_len(args))]


def max_model_len(args) -> int:
    return args.input_len + args.output_len + 64


def measure_dcpgraph(model: str, args, root: Path) -> dict[int, dict]:
    with running_server(model, *server_flags(args), log_path=str(root / "dcpgraph-server.log"),
                        env={"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}) as server:
        return measure(server.url, model, args, root, "dcpgraph")


def measure_vllm(model: str, args, root: Path) -> tuple[dict[int, dict], str]:
    """vLLM's results and a note on how it ran (its torch threads), or ``({}, why it could not run)``."""
    if vllm_cli() is None:
        return {}, f"no vLLM venv at {vllm_venv()}; install it with: {install_command()}"
    log = root / "vllm-server.log"
    try:
        threads = {} if args.vllm_omp_threads is None else {"OMP_NUM_THREADS": str(args.vllm_omp_threads)}
        with running_vllm(model, *server_flags(args), log_path=str(log), kv_cache_gib=args.vllm_kv_gib,
                          env=threads) as server:
            results = measure(server.url, model, args, root, "vllm")
    except (RuntimeError, TimeoutError, OSError) as err:
        return {}, f"vLLM could not serve: {type(err).__name__}: {str(err)[-1500:]}"
    reduced = re.search(r"Reducing Torch threads from (\d+) to (\d+)", log.read_text(errors="replace"))
    threads = reduced.group(2) if reduced else args.vllm_omp_threads or "default"
    return results, f"vllm_torch_threads={threads}"


def records_for(config: str, ours: dict[int, dict], theirs: dict[int, dict]) -> list[dict]:
    """One record per concurrency and metric: dcpgraph's value, vLLM's as the baseline."""
    out = []
    for c, mine in ours.items():
        peer = theirs.get(c)
        point = f"{config} concurrency={c} prompts={mine['completed'] + mine['failed']}"
        for key, metric, unit, scale in METRICS:
            baseline = {"baseline": peer[key] * scale} if peer else {}
            out.append(record(NAME, point, metric, mine[key] * scale, unit, **baseline))
        out.append(record(NAME, point, "failed_requests", mine["failed"], "requests",
                          **({"vllm_failed": peer["failed"]} if peer else {})))
    return out


def cell(ours: dict, theirs: dict | None, key: str, digits: int = 1) -> str:
    """``dcpgraph / vLLM (dcpgraph ÷ vLLM)`` for one result key."""
    if theirs is None:
        return f"{ours[key]:.{digits}f} / -"
    ratio = ours[key] / theirs[key] if theirs[key] else float("nan")
    return f"{ours[key]:.{digits}f} / {theirs[key]:.{digits}f} ({ratio:.2f})"


def print_table(ours: dict[int, dict], theirs: dict[int, dict]) -> None:
    """Side by side: throughput, median/p99 TTFT and TPOT for each server, and the ratios."""
    print(f"\n{'conc':>4} | {'out tok/s dcp / vLLM (ratio)':>30} | {'TTFT p50 ms dcp / vLLM (ratio)':>31} | "
          f"{'TTFT p99':>17} | {'TPOT p50 ms dcp / vLLM (ratio)':>30} | {'TPOT p99':>15}")
    for c, a in ours.items():
        b = theirs.get(c)
        print(f"{c:>4} | {cell(a, b, 'output_throughput'):>30} | {cell(a, b, 'median_ttft_ms'):>31} | "
              f"{cell(a, b, 'p99_ttft_ms', 0):>17} | {cell(a, b, 'median_tpot_ms'):>30} | "
              f"{cell(a, b, 'p99_tpot_ms', 0):>15}")


def main() -> None:
    args = parse_args()
    stop_servers_on_sigterm()
    tmp = tempfile.TemporaryDirectory(prefix="peer_vllm-")
    root = Path(tmp.name)
    shape = QUICK if args.quick else FULL
    # positions for the longest request both servers are asked to admit (8K prompts need more than 4,096)
    shape = dataclasses.replace(shape, max_positions=max(shape.max_positions, max_model_len(args)))
    model = args.model or save_word_checkpoint(root / "model", shape)
    size = "" if args.model else f" params={shape.parameters() / 1e6:.0f}M"
    config = (f"in={args.input_len} out={args.output_len} {args.dtype}{size} max_num_seqs={args.max_num_seqs} "
              f"tp=1 {load_note()}")
    print(f"{NAME}: {config}; dcpgraph first, then vLLM", flush=True)
    ours = measure_dcpgraph(model, args, root)
    theirs, note = measure_vllm(model, args, root)
    config = f"{config} {note}" if theirs else config
    records = records_for(config, ours, theirs)
    if not theirs:
        print(f"\nvLLM NOT MEASURED: {note}\n", flush=True)
        records.append(record(NAME, config, "vllm_unavailable", 1, "flag", error=note))
    print_table(ours, theirs)
    print_records(records)
    print(f"wrote {write(NAME if args.dtype == 'bfloat16' else f'{NAME}_{args.dtype}', records)}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
