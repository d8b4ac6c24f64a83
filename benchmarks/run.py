"""Run dcpgraph's benchmarks and summarise them against their targets.

    python benchmarks/run.py            # every benchmark at full size (tens of minutes on 2 cores)
    python benchmarks/run.py --quick    # small sizes, under 5 minutes on 2 cores
    python benchmarks/run.py --only decode_scaling [--only kv_capacity ...]
    python benchmarks/run.py --device cuda  # the benchmarks that run on a GPU (DEVICE_AWARE), on it

Each benchmark is its own module here (run as a subprocess, so one crash or leak cannot affect
the next) and writes ``benchmarks/results/<name>.json``: a list of records ``{"benchmark",
"config", "metric", "value", "unit"}`` plus ``"baseline"``/``"ratio"`` where there is one, and
``"target"``/``"met"``/``"miss"`` on the rows a target applies to. Its console output goes to
``benchmarks/results/<name>.log`` too. Afterwards this script prints a table (the rows with a
target and each benchmark's headline rows) with a "target" column, writes
``benchmarks/results/summary.md`` (the targets table and every record) and plots
``benchmarks/results/decode_scaling.png`` (attention and step time vs context, dcp=1 vs dcp=2).
Results of benchmarks not run this time are included from their last run and marked so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
QUICK_BUDGET_S = 300

# name -> (extra args for --quick, one-line description)
BENCHMARKS: dict[str, tuple[list[str], str]] = {
    "kv_capacity": (["--quick"], "per-rank KV bytes and capacity, tp-only vs tp+dcp (Qwen3-235B / DeepSeek-V3 shapes)"),
    "decode_scaling": (["--quick"], "decode step and attention time vs context, dcp=1 vs dcp=2, gloo tp=2"),
    "attention_bandwidth": (["--quick"], "paged attention KV-read GB/s vs plain read/copy bandwidth"),
    "compile_time": (["--quick"], "export vs pass time, at two depths"),
    "decode_tokens_per_s": (["--quick"], "engine decode tok/s vs HF generate (tp=1)"),
    "decode_capacity": (["--steps", "16", "--rounds", "2"], "decode step time independent of cache size"),
    "plan_calibration": (["--quick"], "dcpgraph.plan's predicted decode attention time vs measured, dcp 1 and 2, 4K-128K"),
    "kv_preemption": (["--quick"], "concurrency of on-demand KV allocation vs whole-request reservation"),
    "kv_dtype": (["--quick"], "fp8 vs bf16 KV: bytes per token, teacher-forced next-token agreement"),
    "speculative": (["--quick"], "speculative decoding: tokens per step and decode tok/s vs k, per method"),
    "kv_capacity_hybrid": (["--quick"], "sliding/full hybrid models: KV capacity with per-layer-group sizing vs uniform"),
    "pd_transfer": (["--quick"], "P/D KV transfer bytes and time vs prompt length, TTFT via proxy vs mixed"),
    "decode_step": (["--quick"], "whole decode step vs bytes moved ÷ read bandwidth, and vs HF generate, fp32/bf16"),
    "driver_overhead": (["--quick"], "per-step cost of driving tp worker processes (driver step minus the ranks' own)"),
}

# Headline rows shown on the console besides every row with a target.
HEADLINE = {
    "kv_capacity": set(),
    "decode_scaling": {"decode_step_time", "decode_attention_time"},
    "attention_bandwidth": {"read_bandwidth", "copy_bandwidth", "incache_ceiling_bw", "proto_contiguous_bw",
                            "proto_scattered_bw"},
    "compile_time": {"export_time", "verify_time"},
    "decode_tokens_per_s": {"hf_decode_tokens_per_s"},
    "decode_capacity": set(),
    "plan_calibration": set(),
    "kv_preemption": {"peak_running", "mean_running", "steps"},
    "kv_dtype": {"max_logit_error", "mean_logit_error"},
    "speculative": {"tokens_per_step", "decode_tokens_per_s"},
    "kv_capacity_hybrid": {"kv_bytes_per_token"},
    "pd_transfer": {"transfer_time", "ttft_via_proxy"},
    "decode_step": {"read_bandwidth"},
}

# Benchmarks that take ``--device cuda``; the others measure the host only and are not run under it.
DEVICE_AWARE = {"decode_step"}

CAPACITY_SLACK = 1.15  # decode_capacity has no target field: step time at 64x the cache ≤ 1.15x


def run_one(name: str, quick: bool, timeout: float, device: str = "cpu") -> tuple[int, float]:
    cmd = [sys.executable, str(HERE / f"{name}.py"), *(BENCHMARKS[name][0] if quick else [])]
    if device != "cpu":
        cmd += ["--device", device]
    print(f"\n=== {name}: {BENCHMARKS[name][1]}\n$ {' '.join(cmd)}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(RESULTS / f"{name}.log", "w") as log:
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    cwd=HERE.parent, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            for line in proc.stdout:
                log.write(line)
                if not line.startswith("USDT:"):  # the profiler's start/stop chatter
                    print("  " + line, end="", flush=True)
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = -9
    return rc, time.perf_counter() - start


def load(name: str) -> list[dict]:
    """Records of ``<name>.json`` and of the variants the benchmark writes beside it
    (``<name>_<variant>.json``: ``attention_bandwidth_typed``, ``decode_scaling_bf16``, ...), not
    counting another benchmark's file that shares the prefix (``kv_capacity_hybrid``)."""
    paths = [RESULTS / f"{name}.json"]
    paths += sorted(p for p in RESULTS.glob(f"{name}_*.json") if p.stem not in BENCHMARKS)
    records = [r for p in paths if p.exists() for r in json.loads(p.read_text())]
    if name == "decode_capacity":
        for r in records:
            if "ratio" in r and r.get("value") != r.get("baseline") and "target" not in r:
                ok = r["ratio"] <= CAPACITY_SLACK
                r["target"] = f"step time at the large cache ≤ {CAPACITY_SLACK} × small cache"
                r["met"] = ok
                r["miss"] = "" if ok else f"×{r['ratio']:.2f} ({r['ratio'] / CAPACITY_SLACK - 1:.0%} over)"
    return records


def target_cell(r: dict, short: bool = False) -> str:
    if "target" not in r:
        return ""
    if short:
        return "MET" if r["met"] else f"MISSED: {r['miss']}"
    if r["met"]:
        return f"MET ({r['target']})"
    return f"MISSED ({r['target']}): {r['miss']}"


def fmt(x) -> str:
    if x is None or x == "":
        return ""
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def table_rows(records: list[dict], stale: set[str], headline_only: bool, short: bool = False) -> list[list[str]]:
    rows = []
    for r in records:
        if headline_only and "target" not in r and r["metric"] not in HEADLINE.get(r["benchmark"], set()):
            continue
        bench = r["benchmark"] + ("*" if r["benchmark"] in stale else "")
        if not short:
            bench = bench.replace("*", " (earlier run)")
        rows.append([bench, r["metric"], r["config"], fmt(r["value"]), r["unit"], fmt(r.get("baseline")),
                     fmt(r.get("ratio")), target_cell(r, short)])
    return rows


HEADER = ["benchmark", "metric", "config", "value", "unit", "baseline", "ratio", "target"]


def print_table(rows: list[list[str]], width: int = 48) -> None:
    clipped = [[c if i != 2 or len(c) <= width else c[: width - 1] + "…" for i, c in enumerate(row)] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in clipped)) if clipped else len(h) for i, h in enumerate(HEADER)]
    widths[-1] = min(widths[-1], 100)
    print("  ".join(h.ljust(w) for h, w in zip(HEADER, widths)))
    print("  ".join("-" * w for w in widths))
    for row in clipped:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def markdown(rows: list[list[str]]) -> str:
    def esc(c: str) -> str:
        return c.replace("|", "\\|")

    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def plot_decode_scaling(records: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return False

    def series(metric: str, dcp: int, comm: str | None):
        pts = []
        for r in records:
            if r["metric"] == metric and f" dcp={dcp} " in r["config"] and (comm is None or f" comm={comm} " in r["config"]):
                ctx = int(r["config"].split(" ctx=")[1].split()[0])
                pts.append((ctx, r["value"]))
        return sorted(pts)

    if not series("decode_attention_time", 1, None):
        return False
    layers = next((c.split("=")[1] for c in records[0]["config"].split() if c.startswith("L=")), "?")
    comms = sorted({c.split("=")[1] for r in records for c in r["config"].split() if c.startswith("comm=")} - {"auto", "none"})
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    pts = series("decode_attention_time", 1, None)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color="tab:blue", label="paged attention, 1 layer (dcp=1)")
    pts = series("decode_step_time", 1, None)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "s--", color="tab:blue", alpha=0.6,
            label=f"decode step, {layers} layers + collectives (dcp=1)")
    for comm, color in zip(comms or [None], ("tab:orange", "tab:green", "tab:red")):
        name = f"dcp=2{'' if comm is None else ' ' + comm}"
        if comm == (comms[0] if comms else None):
            pts = series("decode_attention_time", 2, comm)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label="paged attention, 1 layer (dcp=2)")
        pts = series("decode_step_time", 2, comm)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "s--", color=color, alpha=0.6,
                label=f"decode step, {layers} layers + collectives ({name})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("time (ms)")
    tgt = [r for r in records if r["metric"] == "decode_step_time" and "target" in r]
    title = "decode time vs context: tp=2, dcp=1 vs dcp=2 (gloo, CPU)"
    if tgt:
        longest = max(tgt, key=lambda r: int(r["config"].split(" ctx=")[1].split()[0]))
        best = min((r for r in tgt if r["config"].split(" ctx=")[1].split()[0] == longest["config"].split(" ctx=")[1].split()[0]),
                   key=lambda r: r["ratio"])
        title += f"\nbest step dcp2/dcp1 at the longest context = {best['ratio']:.2f} ({best['target']})"
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (< 5 minutes on 2 cores)")
    parser.add_argument("--only", action="append", choices=sorted(BENCHMARKS), metavar="NAME",
                        help=f"run only this benchmark (repeatable): {', '.join(BENCHMARKS)}")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per benchmark")
    parser.add_argument("--summary-only", action="store_true", help="rebuild the table and plot from results/")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help=f"cuda: run the device-aware benchmarks ({sorted(DEVICE_AWARE)}) on the GPU")
    parser.add_argument("--results", type=Path, default=None,
                        help="with --summary-only: a folder of saved results to summarise (e.g. results/full)")
    args = parser.parse_args(argv)
    global RESULTS
    if args.results is not None:
        if not args.summary_only:
            parser.error("--results needs --summary-only (the benchmarks write to benchmarks/results)")
        RESULTS = args.results.resolve()
    names = [n for n in BENCHMARKS if not args.only or n in args.only]
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
        skipped = [n for n in names if n not in DEVICE_AWARE]
        if skipped:
            print(f"--device cuda: not run (host-only benchmarks): {skipped}")
        names = [n for n in names if n in DEVICE_AWARE]
    timeout = args.timeout or (600 if args.quick else 7200)
    start = time.perf_counter()
    status: dict[str, tuple[int, float]] = {}
    if not args.summary_only:
        for name in names:
            status[name] = run_one(name, args.quick, timeout, args.device)
    total = time.perf_counter() - start

    records, stale = [], set()
    for name in BENCHMARKS:
        recs = load(name)
        if recs and name not in status and not args.summary_only:
            stale.add(name)
        records += recs
    print("\n" + "=" * 100)
    mode = "quick" if args.quick else "full"
    print(f"dcpgraph benchmarks ({mode}): {len(status)} run in {total:.0f} s")
    for name, (rc, secs) in status.items():
        print(f"  {name:<22} {'ok' if rc == 0 else f'FAILED (exit {rc})':<16} {secs:6.1f} s")
    print()
    print_table(table_rows(records, stale, headline_only=True, short=True))
    if stale:
        print("* not run now: rows from its last run")
    targets = [r for r in records if "target" in r]
    met = sum(r["met"] for r in targets)
    by_bench = {}
    for r in targets:
        ok, n = by_bench.get(r["benchmark"], (0, 0))
        by_bench[r["benchmark"]] = (ok + r["met"], n + 1)
    print(f"\ntargets met: {met}/{len(targets)}  (" +
          ", ".join(f"{b} {ok}/{n}" for b, (ok, n) in by_bench.items()) + ")")
    failed = [n for n, (rc, _) in status.items() if rc != 0]
    if args.quick and status and total > QUICK_BUDGET_S:
        print(f"WARNING: --quick took {total:.0f} s, over its {QUICK_BUDGET_S} s budget")

    plot = RESULTS / "decode_scaling.png"
    # the fp32 model's run (decode_scaling.json); the bf16 run's records sit beside it in the table
    plotted = plot_decode_scaling([r for r in records if r["benchmark"] == "decode_scaling"
                                   and " fp32 " in f" {r['config']} "], plot)
    if args.summary_only:
        md = [f"# dcpgraph benchmarks: saved results in `{RESULTS.name}/`", "",
              "Rebuilt with `python benchmarks/run.py --summary-only` from each benchmark's last saved run "
              "(see each row's config for its size and the load average at the time).", ""]
    else:
        md = [f"# dcpgraph benchmarks ({mode})", "",
              f"Generated by `python benchmarks/run.py{' --quick' if args.quick else ''}` in {total:.0f} s "
              f"on {os.cpu_count()} CPUs (load average at the end {os.getloadavg()[0]:.1f}; the machine is "
              "shared, so every comparison is made inside one run).", ""]
    for name, (rc, secs) in status.items():
        md.append(f"- `{name}`: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {secs:.0f} s — {BENCHMARKS[name][1]}")
    for name in sorted(stale) if not args.summary_only else ():
        md.append(f"- `{name}`: not run now; rows from its last run")
    md += ["", f"**Targets met: {met}/{len(targets)}** (" +
           ", ".join(f"{b} {ok}/{n}" for b, (ok, n) in by_bench.items()) + ")", "",
           "## Targets and headline rows", "", markdown(table_rows(records, stale, headline_only=True)), ""]
    if plotted:
        md += ["## Decode scaling", "", "![decode scaling](decode_scaling.png)", ""]
    md += ["## All records", "", markdown(table_rows(records, stale, headline_only=False)), ""]
    (RESULTS / "summary.md").write_text("\n".join(md))
    print(f"wrote {RESULTS / 'summary.md'}" + (f" and {plot}" if plotted else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
