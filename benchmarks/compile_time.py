"""Compile time: ``torch.export`` vs dcpgraph's passes, and how both grow with depth.

Full-depth models with small widths (``dcpgraph.models.tiny_config``: hidden 64, 8 heads, fp32):
DeepSeek-V3 (MLA + MoE) at 61 layers and Qwen3 at 36 layers, each also at about half depth.
For each: ``dcpgraph.trace`` (export + ``canonicalize_attention``), then
``compile_program(mesh=tp2/dcp2, verify=True)``. Times come from ``Program.provenance`` (wall
seconds the pass manager records per pass; the ``trace`` record is ``torch.export`` itself), and
the verifier's share is the compile time minus the passes' sum. The machine is shared, so by
default (``--clock cpu``) the timer that ``dcpgraph.passes.manager`` and
``dcpgraph.frontends.export`` read is swapped, for this process only, for ``time.process_time``:
provenance then holds CPU seconds, and time this process spent preempted by other jobs does not
count. ``--clock wall`` keeps the library's own wall-clock provenance. A 1-layer trace and compile
runs first, untimed (the first ``torch.export`` in a process pays one-time costs).

Targets: total pass time (``canonicalize_attention`` + the five pipeline passes, without
verification) ≤ 0.5 × export time; and linear growth: pass time at full depth / half depth
≤ 1.25 × the layer ratio (a pass that is quadratic in the graph size would blow it).

The pipeline is compiled 2 (``--quick``) or 3 times from the one trace; each pass's minimum counts.

``--quick``: 3 and 6 layers of each model.

    python3 benchmarks/compile_time.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import torch  # noqa: E402

import dcpgraph  # noqa: E402
from dcpgraph.mesh import Mesh  # noqa: E402
from dcpgraph.models import build_model  # noqa: E402
from dcpgraph.passes.pipeline import compile_program  # noqa: E402

NAME = "compile_time"
MESH = Mesh(2, 2)
MODELS = {"deepseek_v3": (61, 30), "qwen3": (36, 18)}
QUICK = {"deepseek_v3": (6, 3), "qwen3": (6, 3)}
PASS_TARGET = 0.5
GROWTH_SLACK = 1.25
CLOCK = ["cpu"]


class _CpuClock:
    """Stands in for the ``time`` module in the library's timing code: ``perf_counter`` → CPU."""

    perf_counter = staticmethod(time.process_time)
    process_time = staticmethod(time.process_time)


def use_cpu_clock() -> None:
    import dcpgraph.frontends.export as export_mod
    import dcpgraph.passes.manager as manager_mod

    export_mod.time = _CpuClock
    manager_mod.time = _CpuClock


def measure(arch: str, layers: int, repeats: int = 1) -> dict:
    """Trace once; compile ``repeats`` times from the same trace and keep each pass's minimum
    (the passes are cheap next to export, and the minimum damps the shared machine's noise)."""
    model = build_model(arch, dtype=torch.float32, layers=layers)
    gc.collect()
    program = dcpgraph.trace(model)
    traced = len(program.provenance)
    prov = {p.name: p.seconds for p in program.provenance}
    export = prov.pop("trace")
    passes = dict(prov)  # canonicalize_attention
    verify = float("inf")
    for _ in range(repeats):
        gc.collect()
        c0 = clock()
        compiled = compile_program(program, MESH, verify=True)
        total = clock() - c0
        pipeline = {p.name: p.seconds for p in compiled.provenance[traced:]}
        for name, sec in pipeline.items():
            passes[name] = min(passes.get(name, float("inf")), sec)
        verify = min(verify, total - sum(pipeline.values()))
    return {
        "layers": layers, "export": export, "passes": passes, "pass_total": sum(passes.values()),
        "verify": verify,  # the pipeline's verification (+ the manager's own overhead)
        "nodes": len(compiled.graph_module.graph.nodes),
    }


def clock() -> float:
    return time.process_time() if CLOCK[0] == "cpu" else time.perf_counter()


def records_for(arch: str, m: dict) -> list[dict]:
    config = (f"{arch} tiny L={m['layers']} fp32 tp={MESH.tp} dcp={MESH.dcp} ({m['nodes']} nodes) "
              f"clock={CLOCK[0]} {common.load_note()}")
    recs = [common.record(NAME, config, "export_time", m["export"], "s", digits=4)]
    for name, sec in m["passes"].items():
        recs.append(common.record(NAME, config, f"pass:{name}", sec, "s", baseline=m["export"], digits=4))
    total = common.record(NAME, config, "pass_time_total", m["pass_total"], "s", baseline=m["export"], digits=4)
    ratio = m["pass_total"] / m["export"]
    common.with_target(total, f"≤ {PASS_TARGET} × export", ratio <= PASS_TARGET,
                       f"{ratio:.2f} × export ({ratio / PASS_TARGET - 1:.0%} over)")
    recs.append(total)
    recs.append(common.record(NAME, config, "verify_time", m["verify"], "s", baseline=m["export"], digits=4))
    return recs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    CLOCK[0] = args.clock
    if args.clock == "cpu":
        use_cpu_clock()
    start = time.perf_counter()
    records = []
    measure("qwen3", 1)  # warm-up, not recorded
    for arch, depths in (QUICK if args.quick else MODELS).items():
        results = {}
        for layers in sorted(depths):
            m = measure(arch, layers, repeats=2 if args.quick else 3)
            results[layers] = m
            print(f"{arch} L={layers}: export {m['export']:.2f} s, passes {m['pass_total']:.2f} s "
                  f"({', '.join(f'{k} {v:.2f}' for k, v in m['passes'].items())}), verify {m['verify']:.2f} s, "
                  f"{m['nodes']} nodes")
            records += records_for(arch, m)
        small, big = sorted(results)
        layer_ratio = big / small
        for what, key in (("pass_time_total", "pass_total"), ("export_time", "export"), ("verify_time", "verify")):
            growth = results[big][key] / results[small][key]
            rec = common.record(NAME, f"{arch} tiny L={small}->{big} (layers x{layer_ratio:.2f}) clock={args.clock}",
                                f"growth:{what}", results[big][key], "s", baseline=results[small][key], digits=4)
            if key == "pass_total":
                common.with_target(rec, f"≤ {GROWTH_SLACK} × layer ratio ({GROWTH_SLACK * layer_ratio:.2f})",
                                   growth <= GROWTH_SLACK * layer_ratio,
                                   f"grew ×{growth:.2f} for ×{layer_ratio:.2f} layers (superlinear)")
            records.append(rec)
            per_pass = ""
            if key == "pass_total":
                per_pass = " (" + ", ".join(
                    f"{k} ×{results[big]['passes'][k] / max(results[small]['passes'][k], 1e-9):.2f}"
                    for k in results[big]["passes"]) + ")"
            print(f"{arch}: {what} grew ×{growth:.2f} for ×{layer_ratio:.2f} layers{per_pass}")
    common.print_records([r for r in records if "target" in r])
    out = common.write(NAME, records)
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
