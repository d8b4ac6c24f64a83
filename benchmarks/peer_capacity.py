"""dcpgraph at tp=2·dcp=2 beside vLLM's CPU build at tp=2, in the same per-rank KV budget: how
many concurrent requests of ``--input-len`` + ``--output-len`` tokens each server holds at once,
and their throughput when each is driven at its own count.

    python benchmarks/peer_capacity.py --quick     # 2 vs 4 requests of 256 + 512 tokens (smoke)
    python benchmarks/peer_capacity.py             # 8,192 + 512 tokens: 4 vs 8 requests

The checkpoint has one KV head (MQA, head_dim 64), fewer than tp: vLLM keeps that head whole on
both TP ranks, dcpgraph's tp2·dcp2 splits its tokens between them (docs/benchmarks.md explains the
method). Both servers get the same bytes of KV per rank through the same flag,
``--kv-cache-memory-bytes`` (per worker in vLLM's CPU worker, per rank in dcpgraph;
``VLLM_CPU_KVCACHE_SPACE`` is left unset: vLLM reads it as whole GiB and it would override the
flag). By default that budget is what vLLM needs for ``--vllm-requests`` requests plus its null
block (computed from the checkpoint's config); ``--kv-bytes`` sets it directly. Both servers get
``--max-model-len`` = input + output, so vLLM's start-up line reports its concurrency for exactly
one request's tokens.

Per server, one after the other: start it; read its KV cache from its start-up log and its
``/metrics`` ``cache_config_info`` (:mod:`dcpgraph.testing.peer_capacity` counts both the same
way: usable blocks ÷ blocks per request); then a warm-up of that many short requests at once, and
one wave of ``vllm bench serve``, ``--num-prompts`` = ``--max-concurrency`` = that count, while a
thread polls ``/metrics`` for the most requests running at once and the preemptions. A count is confirmed when
the peak equals it and nothing was preempted. Records (``benchmarks/results/peer_capacity.json``):
``capacity_requests`` (dcpgraph's value, vLLM's as the baseline, their ratio; target ≥ 1.8×),
``kv_tokens``, ``peak_running``, ``preemptions`` and the throughput, TTFT and TPOT of each wave.

vLLM at tp=2 on a one-NUMA-node machine cannot bind its threads itself (its "auto" binding wants a
NUMA node per rank): ``--vllm-cpu-bind`` (default ``0|1``, one core per rank) is passed as
``VLLM_CPU_OMP_THREADS_BIND``. dcpgraph's ranks run one torch thread each.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import load_note, print_records, record, stop_servers_on_sigterm, with_target, write
from peer_vllm import METRICS

from dcpgraph.testing.peer_capacity import (
    DTYPE_BYTES,
    KvCapacity,
    checkpoint_shape,
    dcpgraph_capacity,
    parse_dcpgraph_capacity,
    parse_vllm_capacity,
    vllm_budget_bytes,
    vllm_capacity,
    watch_running,
)
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

NAME = "peer_capacity"
SERVED = "peer"
TARGET = 1.8  # dcpgraph's count ÷ vLLM's at the same per-rank KV budget
WARMUP_INPUT_LEN = 256  # the warm-up's prompts: short, distinct from the wave's
# One KV head (fewer than tp = 2), head_dim 64; small so the 8K wave fits in minutes on 2 cores.
FULL = ModelShape(hidden=256, layers=4, heads=4, kv_heads=1, intermediate=768, vocab=8192, max_positions=16384)
QUICK = ModelShape(hidden=256, layers=2, heads=4, kv_heads=1, intermediate=512, vocab=2048, max_positions=1024)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint with fewer KV heads than --tp and head_dim 64 or "
                                                 "128 (default: a random one-KV-head Qwen3 written for the run)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES))
    p.add_argument("--input-len", type=int, default=8192)
    p.add_argument("--output-len", type=int, default=512, help="new tokens per request: enough decode steps "
                                                                   "with every request running for /metrics polls to see")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dcp", type=int, default=2)
    p.add_argument("--vllm-requests", type=int, default=4,
                   help="size the per-rank KV budget to hold this many requests in vLLM (plus its null block)")
    p.add_argument("--kv-bytes", type=int, default=None, help="the per-rank KV budget in bytes (instead of "
                                                              "--vllm-requests)")
    p.add_argument("--vllm-cpu-bind", default="0|1", help="VLLM_CPU_OMP_THREADS_BIND for vLLM (one list per rank)")
    p.add_argument("--quick", action="store_true", help="a 2-layer model, 256 + 512 tokens, a budget of 2 vLLM "
                                                        "requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default=None, help="keep the checkpoint, server logs and bench results here "
                                                    "(default: a temporary directory, removed at the end)")
    args = p.parse_args(argv)
    if args.quick:
        # 512 new tokens: vLLM decodes a small wave at 7-25 ms a token here and a /metrics scrape
        # takes up to 0.7 s, so a short wave can end between two polls
        args.input_len, args.output_len, args.vllm_requests = 256, 512, 2
    return args


def wave(server_url: str, model: str, args, root: Path, who: str, concurrency: int) -> tuple[dict, object]:
    """A warm-up of ``concurrency`` short requests at once (decode batches up to that size run once;
    not watched: they would share no blocks with the wave), then the measured wave of
    ``concurrency`` requests at once, watched on /metrics."""
    def command(name: str, input_len: int, seed: int) -> list[str]:
        return bench_command(server_url, model, SERVED, backend="openai", num_prompts=concurrency, input_len=input_len,
                             output_len=args.output_len, concurrency=concurrency, result_dir=str(root),
                             result_file=f"{name}.json", seed=seed, warmups=0)

    start = time.perf_counter()
    run_bench(command(f"{who}-warmup", min(args.input_len, WARMUP_INPUT_LEN), args.seed + 1),
              str(root / f"{who}-warmup.log"), timeout_s=1800)
    warm = time.perf_counter()
    with watch_running(server_url) as peak:
        result = run_bench(command(who, args.input_len, args.seed), str(root / f"{who}-bench.log"), timeout_s=3600)
    print(f"  {who}: {concurrency} at once: peak running {peak.peak_running}, peak waiting {peak.peak_waiting}, "
          f"{peak.preemptions} preempted ({peak.polls} /metrics polls, {len(peak.errors)} failed), {result['output_throughput']:.1f} output tok/s, {result['failed']} failed "
          f"(warm-up {warm - start:.0f} s, wave {time.perf_counter() - warm:.0f} s)", flush=True)
    return result, peak


def server_flags(args, budget: int) -> list[str]:
    """Both servers' flags (vLLM's names)."""
    return ["--served-model-name", SERVED, "--dtype", args.dtype, "--max-model-len", str(tokens(args)),
            "--kv-cache-memory-bytes", str(budget), "--tensor-parallel-size", str(args.tp)]


def tokens(args) -> int:
    return args.input_len + args.output_len


def saved_metrics(url: str, path: Path) -> str:
    """The server's ``/metrics`` text at start-up, also written to ``path`` (kept with ``--work-dir``)."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    path.write_text(text)
    return text


def measure_dcpgraph(model: str, args, root: Path, budget: int) -> dict:
    log = root / "dcpgraph-server.log"
    with running_server(model, *server_flags(args, budget), "--decode-context-parallel-size", str(args.dcp),
                        log_path=str(log)) as server:
        kv = dcpgraph_capacity(saved_metrics(server.url, root / "dcpgraph-metrics.txt"))
        line = parse_dcpgraph_capacity(log.read_text(errors="replace"))
        if (line.blocks, line.tokens) != (kv.num_blocks, kv.usable_tokens):
            raise RuntimeError(f"dcpgraph's start-up line {line} disagrees with its /metrics {kv}")
        count = kv.requests(tokens(args))
        print(f"  dcpgraph: {kv.num_blocks} blocks per rank of {kv.block_size} tokens × dcp {kv.dcp}: "
              f"{kv.usable_tokens} tokens, {count} requests of {tokens(args)}", flush=True)
        result, peak = wave(server.url, model, args, root, "dcpgraph", count)
    return {"kv": kv, "count": count, "reported": kv.usable_tokens / tokens(args), "result": result, "peak": peak}


def measure_vllm(model: str, args, root: Path, budget: int) -> tuple[dict | None, str]:
    """vLLM's figures, or ``(None, why it could not run)``."""
    if vllm_cli() is None:
        return None, f"no vLLM venv at {vllm_venv()}; install it with: {install_command()}"
    log = root / "vllm-server.log"
    try:
        with running_vllm(model, *server_flags(args, budget), log_path=str(log), kv_cache_gib=None,
                          env={"VLLM_CPU_OMP_THREADS_BIND": args.vllm_cpu_bind}) as server:
            kv = vllm_capacity(saved_metrics(server.url, root / "vllm-metrics.txt"))
            line = parse_vllm_capacity(log.read_text(errors="replace"))
            if line.per_request != tokens(args):
                raise RuntimeError(f"vLLM reports its concurrency for {line.per_request} tokens, not {tokens(args)}")
            count = kv.requests(tokens(args))
            print(f"  vLLM: {kv.num_blocks} blocks of {kv.block_size} tokens (one the null block): "
                  f"{kv.usable_tokens} usable tokens, {count} requests of {tokens(args)}; its line: "
                  f"{line.tokens:,} tokens, {line.concurrency:.2f}x", flush=True)
            result, peak = wave(server.url, model, args, root, "vllm", count)
    except (RuntimeError, TimeoutError, OSError, ValueError) as err:
        return None, f"vLLM could not serve: {type(err).__name__}: {str(err)[-1500:]}"
    return {"kv": kv, "count": count, "reported": line.concurrency, "result": result, "peak": peak}, "ok"


def confirmed(side: dict) -> bool:
    """The server ran its whole count at once and preempted nothing."""
    return side["peak"].peak_running == side["count"] and side["peak"].preemptions == 0


def records_for(config: str, ours: dict, theirs: dict | None) -> list[dict]:
    """The capacity rows, then the waves' rows: dcpgraph's value, vLLM's as the baseline."""
    peer = theirs or {}

    def row(metric: str, value, unit: str, other=None, **extra) -> dict:
        return record(NAME, config, metric, value, unit, **({"baseline": other} if theirs else {}), **extra)

    kv: KvCapacity = ours["kv"]
    capacity = row("capacity_requests", ours["count"], "requests", peer.get("count"),
                   dcpgraph_confirmed=confirmed(ours), **({"vllm_confirmed": confirmed(theirs)} if theirs else {}))
    if theirs:
        ratio = ours["count"] / theirs["count"] if theirs["count"] else float("inf")
        with_target(capacity, f"≥ {TARGET}× vLLM's count", ratio >= TARGET, f"{ratio:.2f}×")
    out = [capacity,
           row("kv_tokens", kv.usable_tokens, "tokens", peer["kv"].usable_tokens if theirs else None,
               dcpgraph_blocks=kv.num_blocks, **({"vllm_blocks": peer["kv"].num_blocks} if theirs else {})),
           row("reported_max_concurrency", ours["reported"], "requests", peer.get("reported")),
           row("peak_running", ours["peak"].peak_running, "requests", peer["peak"].peak_running if theirs else None,
               dcpgraph_polls=ours["peak"].polls, **({"vllm_polls": peer["peak"].polls} if theirs else {})),
           record(NAME, config, "preemptions", ours["peak"].preemptions, "preemptions",
                  **({"vllm_preemptions": peer["peak"].preemptions} if theirs else {}))]
    wave_config = f"{config} concurrency={ours['count']}" + (f"/vllm={theirs['count']}" if theirs else "")
    for key, metric, unit, scale in METRICS:
        out.append(record(NAME, wave_config, metric, ours["result"][key] * scale, unit,
                          **({"baseline": theirs["result"][key] * scale} if theirs else {})))
    out.append(record(NAME, wave_config, "failed_requests", ours["result"]["failed"], "requests",
                      **({"vllm_failed": theirs["result"]["failed"]} if theirs else {})))
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    stop_servers_on_sigterm()
    tmp = None if args.work_dir else tempfile.TemporaryDirectory(prefix="peer_capacity-")
    root = Path(args.work_dir or tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    shape = QUICK if args.quick else FULL
    model = args.model or save_word_checkpoint(root / "model", shape)
    kv_shape = checkpoint_shape(model)
    if kv_shape["kv_heads"] >= args.tp:
        print(f"warning: {kv_shape['kv_heads']} KV heads at tp={args.tp}: vLLM replicates nothing, so DCP saves "
              "nothing here", flush=True)
    budget = args.kv_bytes or vllm_budget_bytes(kv_shape, args.tp, args.dtype, tokens(args), args.vllm_requests)
    size = "" if args.model else f" params={shape.parameters() / 1e6:.1f}M"
    config = (f"in={args.input_len} out={args.output_len} {args.dtype}{size} layers={kv_shape['layers']} "
              f"kv_heads={kv_shape['kv_heads']} head_dim={kv_shape['head_dim']} kv_bytes_per_rank={budget} "
              f"dcpgraph tp={args.tp} dcp={args.dcp} vs vLLM tp={args.tp} bind={args.vllm_cpu_bind} {load_note()}")
    print(f"{NAME}: {config}; dcpgraph first, then vLLM", flush=True)
    ours = measure_dcpgraph(model, args, root, budget)
    theirs, note = measure_vllm(model, args, root, budget)
    records = records_for(config, ours, theirs)
    if theirs is None:
        print(f"\nvLLM NOT MEASURED: {note}\n", flush=True)
        records.append(record(NAME, config, "vllm_unavailable", 1, "flag", error=note))
    print_records(records)
    print(f"wrote {write(NAME if not args.quick else f'{NAME}_quick', records)}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
