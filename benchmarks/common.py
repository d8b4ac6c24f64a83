"""Helpers shared by the benchmarks (not a benchmark itself: ``run.py`` skips this module).

Records are plain dicts ``{"benchmark", "config", "metric", "value", "unit"}`` plus, where there
is one, ``"baseline"`` and ``"ratio"`` (= value / baseline), and, for rows that carry a target,
``"target"`` (the rule, in words), ``"met"`` (bool) and ``"miss"`` (how far off, in words; empty
when met). The machine is shared and noisy, so every comparison is made inside one run, with the
compared variants interleaved rep by rep.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Where results are written: ``DCPGRAPH_RESULTS_DIR`` keeps another machine's runs apart (results
# are this machine's figures; e.g. benchmarks/results/amd_epyc_zen2 for an AVX2 machine's).
RESULTS = Path(os.environ.get("DCPGRAPH_RESULTS_DIR") or ROOT / "benchmarks" / "results")
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))


def stop_servers_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit`` so a benchmark killed by ``kill``/``pkill`` unwinds its
    ``running_server``/``running_vllm`` contexts and stops the servers it started (Python's default
    SIGTERM ends the process without running ``finally`` blocks, leaving them serving)."""
    import signal

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def record(benchmark: str, config: str, metric: str, value: float, unit: str, *, baseline: float | None = None,
           ratio: float | None = None, digits: int = 6, **extra) -> dict:
    rec = {"benchmark": benchmark, "config": config, "metric": metric, "value": _round(value, digits), "unit": unit}
    if baseline is not None:
        rec["baseline"] = _round(baseline, digits)
        rec["ratio"] = _round(ratio if ratio is not None else (value / baseline if baseline else float("nan")), 4)
    rec.update(extra)
    return rec


def with_target(rec: dict, target: str, met: bool, miss: str = "") -> dict:
    rec["target"] = target
    rec["met"] = bool(met)
    rec["miss"] = "" if met else miss
    return rec


def _round(x, digits):
    if isinstance(x, float):
        return float(f"{x:.{digits}g}")
    return x


def write(name: str, records: list[dict], out: Path | None = None) -> Path:
    out = out or RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=2) + "\n")
    return out


def cpu_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (empty where it gives none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def load_note() -> str:
    """The CPU and the 1-minute load average (the machine is shared): part of every config string."""
    cpu = cpu_name().replace(" ", "_")
    try:
        return f"cpu={cpu or '?'} load={os.getloadavg()[0]:.1f}/{os.cpu_count()}cpu"
    except OSError:
        return f"cpu={cpu or '?'} load=?"


def last_level_cache_bytes(default: int = 64 << 20) -> int:
    """Size of the largest CPU cache sysfs lists for cpu0 (``default`` where it lists none)."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in "KMG" else text
        if digits.isdigit():
            best = max(best, int(digits) * unit)
    return best or default


def copies_past_cache(nbytes: int, cache_bytes: int | None = None) -> int:
    """How many copies of an ``nbytes`` working set, visited in turn, add up to twice the last-level
    cache: each copy has then been evicted before it is read again, so a loop over them is served
    from memory, as a decode step's walk over its layers' KV caches is."""
    cache = last_level_cache_bytes() if cache_bytes is None else cache_bytes
    return max(1, -(-2 * cache // max(1, nbytes)))


def interleaved(fns: dict[str, Callable[[], object]], reps: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of each call, the variants interleaved rep by rep so noise hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return times


def median(xs):
    return statistics.median(xs)


def print_records(records: list[dict]) -> None:
    for r in records:
        extra = ""
        if "ratio" in r:
            extra = f"  (baseline {r['baseline']}, ratio {r['ratio']})"
        tgt = ""
        if "target" in r:
            tgt = f"  [{'MET' if r['met'] else 'MISSED'}: {r['target']}{'; ' + r['miss'] if r['miss'] else ''}]"
        print(f"  {r['metric']:<28} {r['value']:>14} {r['unit']:<8} {r['config']}{extra}{tgt}")


def finish(name: str, records: list[dict], start: float) -> int:
    """A benchmark's last lines: print its records and the targets met, write them, say where."""
    import time

    print_records(records)
    met = [r["met"] for r in records if "target" in r]
    print(f"targets: {sum(met)}/{len(met)} met")
    out = write(name, records)
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0
