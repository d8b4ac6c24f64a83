"""Decode step and attention time vs context, dcp=1 vs dcp=2, on real gloo processes (tp=2),
with a per-layer breakdown of where the step's time goes.

Model: a Qwen3 with 8 query heads and **1 KV head** of dim 128 (so tp=2 replicates the KV head
and dcp=2 is valid), hidden 256, ``--layers`` layers (8 by default), fp32 (``--dtype bf16``: a bf16
model, whose bf16 queries take the native kernel's AMX path), random weights. The
meshes compared are compiled in the same two ``spawn``-ed gloo processes (one thread each), with caches
sized for the longest context (8 layers x 128K tokens x K and V x 128 x 4 B = 1 GiB per rank for
dcp=1, half that for each dcp=2 mesh: 4 GiB over both ranks, on a 24 GiB machine).

**Fair baseline.** dcp=1 is the same traced model, the same two processes and threads, tp=2: one KV
head under tp=2 is replicated, so each dcp=1 rank reads the whole context for its 4 query heads,
and each dcp=2 rank reads half the context for the DCP group's 8 query heads.

**How the context gets there.** Prefilling 128K tokens through the model is needlessly slow on 2
cores (and what it writes does not matter for timing), so the caches are filled with random
values and each request is admitted with its prompt of ``C`` tokens marked as already computed
except the last (``request.computed = C − 1``): the first ``step()`` is then a decode step at
context ``C − 1`` whose token is written to its slot as usual, and every later step is an ordinary
decode step. Block tables come from the engine's own block manager (consecutive blocks here).

Three meshes by default, all tp=2 in the same processes (``VARIANTS``): ``dcp1``; ``dcp2``, the
default ``comm="auto"`` (what users get: the lowering the cost model predicts cheapest, recorded in
each row's config as ``comm=<chosen> requested=auto`` and its reason printed); ``dcp2-a2a``,
``comm="a2a"`` (per layer: query all-gather, all-to-all of packed partials, the output projection's
all-reduce, the MLP's all-reduce). On request (``--variants``): ``dcp2-ag``, ``comm="ag"`` (per
layer: one all-gather of packed partials of every head and the MLP's all-reduce, the attention
projections replicated; :mod:`dcpgraph.passes.shard_dcp_replicated`), and ``dcp2-ag_rs`` (query
all-gather, LSE all-gather, reduce-scatter, two all-reduces), and ``dcp2-split``, ``dcp2`` with
``fuse_new_tokens=False`` (a separate new-token attention and a two-way merge after the DCP merge,
the form the Ascend backends build). dcp1 has two collectives per layer.

Per context length ``C`` (16K…128K; ``--quick``: 4K and 16K) the meshes take turns step by step,
each with its own request (the logical group names are re-registered for the engine about to run,
outside the timed step), so a change in the machine's load hits every mesh alike. Measured:

* ``decode_step_time``: median wall time of ``engine.step()`` on rank 0, each step started right
  after a barrier so both ranks begin together; each dcp=2 row carries its ratio to dcp=1 and the
  target (≤ 1.0 from 16K, ≤ 0.7 at 128K);
* ``decode_attention_time``: ``torch.ops.dcpgraph.paged_attention`` for one layer alone, on each
  rank's real cache at that rank's local length, with the query-head count of that mesh's graph
  (dcp=2 attends with every query head of the DCP group), both ranks at once; median of rank 0's
  thread CPU time (so preemption by other jobs does not count); target ≤ 0.6 × dcp=1 at the
  longest context (each dcp=2 rank reads half the KV bytes);
* ``breakdown_<part>``: per layer (a part's time per step ÷ layers), from explicit timers around
  every node of the graph on both ranks (a ``torch.fx.Interpreter``, so the per-node interpreter
  cost lands in ``other ops``) over a few steps, rank 0's median step. Parts: ``query all-gather``
  and ``merge exchange`` (the DCP collectives before/after the context attention), ``tp
  all-reduce``, each split into ``launch`` (the collective call) and ``wait`` (its
  ``wait_tensor``: waiting for the other rank and the transfer), ``local attention``
  (``paged_attention``), ``new-token attention`` (``partial_attention``), ``merge``
  (``merge_attention``/``rescale_to_global``), ``layout copies`` (clone, ``_to_copy``, cat, stack,
  contiguous), ``other ops`` (projections, norms, the rest), and ``engine`` (the step's time
  outside the graph: scheduling, inputs, sampling).

Writes ``benchmarks/results/decode_scaling.json``; ``run.py`` plots it.

    python3 benchmarks/decode_scaling.py [--quick] [--layers 8] [--contexts 16384 131072]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import torch  # noqa: E402

NAME = "decode_scaling"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TP = 2
BLOCK = 16
LAYERS = 8
ATTENTION_TARGET = 0.6  # one layer's paged attention, dcp=2 / dcp=1, at the longest context
STEP_TARGET_FROM = 16384  # dcp=2 step ≤ 1.0 × dcp=1 from this context on
STEP_TARGET_LONG = (131072, 0.7)  # and ≤ 0.7 × at 128K
FULL_CONTEXTS = (16384, 32768, 65536, 131072)
QUICK_CONTEXTS = (4096, 16384)
PARTS = ("query all-gather launch", "query all-gather wait", "merge exchange launch", "merge exchange wait",
         "tp all-reduce launch", "tp all-reduce wait", "local attention", "new-token attention", "merge",
         "layout copies", "other ops", "engine")
# The compared meshes, all tp=2 in the same two processes: name -> (dcp, comm, fuse_new_tokens).
# "dcp2" is what users get (comm="auto", the cost model's choice; the new tokens read with the
# context); the others pin a lowering: a2a (query all-gather, packed all-to-all, output all-reduce),
# ag (one all-gather of packed partials per layer, see shard_dcp_replicated), ag_rs (query
# all-gather, LSE all-gather, reduce-scatter); "dcp2-split" is "dcp2" with the new-token attention
# kept apart (the Ascend backends' form), to measure what reading them with the context saves.
VARIANTS = {"dcp1": (1, "auto", True), "dcp2": (2, "auto", True), "dcp2-a2a": (2, "a2a", True),
            "dcp2-ag": (2, "ag", True), "dcp2-ag_rs": (2, "ag_rs", True), "dcp2-split": (2, "auto", False)}
DEFAULT_VARIANTS = ("dcp1", "dcp2", "dcp2-a2a")  # ag and ag_rs pinned on request
BASELINE = "dcp1"


def build_model(layers: int = LAYERS, dtype: torch.dtype = torch.float32):
    import transformers as tf

    cfg = tf.Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=1, head_dim=128,
                         max_position_embeddings=1 << 18, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def _attention_query_heads(program) -> int:
    for node in program.graph_module.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.dcpgraph.paged_attention.default:
            return int(node.args[0].meta["val"].shape[1])
    raise RuntimeError("no paged_attention node")


_LAYOUT_OPS = {"clone", "_to_copy", "cat", "stack", "contiguous", "copy_", "index_select"}


def node_parts(graph) -> dict:
    """Each call node -> its part of the breakdown (see the module docstring). A DCP collective is
    a ``query all-gather`` when its result reaches a context attention within a few nodes, else a
    ``merge exchange``; a ``wait_tensor`` belongs to the collective it completes."""
    from dcpgraph.collectives import WAIT, collective_of
    from dcpgraph.passes.collectives import collective_group

    dcp_ops = torch.ops.dcpgraph
    reads = {dcp_ops.paged_attention.default, dcp_ops.paged_sparse_attention.default}

    def feeds_attention(node, depth=4) -> bool:
        frontier = [node]
        for _ in range(depth):
            frontier = [u for n in frontier for u in n.users]
            if any(u.op == "call_function" and u.target in reads for u in frontier):
                return True
        return False

    parts = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if collective_of(target) is not None:
            kind = collective_group(node)[0]
            part = "tp all-reduce" if kind == "tp" else (
                "query all-gather" if feeds_attention(node) else "merge exchange")
            parts[node] = part + " launch"
        elif target is WAIT:
            parts[node] = parts[node.args[0]].replace(" launch", " wait")
        elif target in reads:
            parts[node] = "local attention"
        elif target is dcp_ops.partial_attention.default:
            parts[node] = "new-token attention"
        elif target in (dcp_ops.merge_attention.default, dcp_ops.rescale_to_global.default):
            parts[node] = "merge"
        elif getattr(target, "__name__", "").split(".")[0] in _LAYOUT_OPS:
            parts[node] = "layout copies"
        else:
            parts[node] = "other ops"
    return parts


class TimedGraph:
    """Runs a GraphModule node by node with a wall-clock timer around each call node, adding each
    node's seconds to ``totals[part]``; stands in for the executor's graphs (``get(key)``)."""

    def __init__(self, gm) -> None:
        self.gm, self.parts = gm, node_parts(gm.graph)
        self.totals: dict[str, float] = {}

    def get(self, key):
        return self

    def __call__(self, *args):
        parts, totals, clock = self.parts, self.totals, time.perf_counter

        class Timed(torch.fx.Interpreter):
            def run_node(self, n):
                t0 = clock()
                result = super().run_node(n)
                if n in parts:
                    totals[parts[n]] = totals.get(parts[n], 0.0) + clock() - t0
                return result

        t0 = clock()
        out = Timed(self.gm).run(*args)
        totals["graph"] = totals.get("graph", 0.0) + clock() - t0
        return out


def worker(rank: int, world: int, contexts: list[int], layers: int, variants: dict, steps: int, warm: int,
           rounds: int, attn_reps: int, timed_steps: int, dtype_name: str = "fp32") -> dict:
    import torch.distributed as dist

    import dcpgraph
    from dcpgraph import layout
    from dcpgraph.runtime.distributed import register_mesh_groups

    torch.manual_seed(1234 + rank)
    longest = max(contexts)
    per_request = warm + steps
    dtype = DTYPES[dtype_name]
    program = dcpgraph.trace(build_model(layers, dtype))
    engines = {}
    for name, (dcp, comm, fuse) in variants.items():
        engines[name] = dcpgraph.compile(
            program, tp=TP, dcp=dcp, comm=comm, fuse_new_tokens=fuse, block_size=BLOCK, backend="eager", max_num_seqs=1,
            max_num_batched_tokens=256, max_model_len=longest + per_request + timed_steps + 8,
            kv_cache_tokens=longest + per_request + timed_steps + 8, capture_limit=1,
        )
        for cache in engines[name].executor.caches.values():
            cache.normal_()
    heads = {name: _attention_query_heads(e.program) for name, e in engines.items()}
    chosen = {name: e.program.lowering.comm for name, e in engines.items()}
    reasons = {name: e.program.lowering.comm_choice for name, e in engines.items() if e.program.lowering.comm_choice is not None}
    gen = torch.Generator().manual_seed(0)
    prompt_all = torch.randint(0, 512, (longest,), generator=gen).tolist()

    def use_mesh(mesh):
        """Register ``mesh``'s group names (new DCP subgroups when it changes) and run one barrier
        on its DCP group, so no timed step pays for a fresh communicator's first call."""
        groups = register_mesh_groups(mesh)
        dist.barrier(group=groups["dcp"])

    def start(engine, ctx, n):
        rid = engine.add_request(prompt_all[:ctx], n)
        engine.scheduler.get(rid).computed = ctx - 1  # the context is "in the cache" (random values)
        return rid

    results: dict = {"heads": heads, "comm": chosen, "comm_choice": reasons, "contexts": {}}
    for ctx in contexts:
        step_wall = {name: [] for name in engines}
        step_cpu = {name: [] for name in engines}
        for _ in range(rounds):
            rids = {name: start(engine, ctx, per_request) for name, engine in engines.items()}
            for i in range(per_request):  # the meshes take turns step by step: load drifts hit all alike
                for name, engine in engines.items():
                    use_mesh(engine.mesh)
                    dist.barrier()
                    w0, c0 = time.perf_counter(), time.thread_time()
                    events = engine.step()
                    w1, c1 = time.perf_counter(), time.thread_time()
                    assert len(events) == 1
                    if i >= warm:
                        step_wall[name].append(w1 - w0)
                        step_cpu[name].append(c1 - c0)
            assert all(engines[name].scheduler.get(rid) is None for name, rid in rids.items())  # finished
        # Where the time goes: every graph node timed, on both ranks, step by step.
        breakdown = {}
        for name, engine in engines.items():
            use_mesh(engine.mesh)
            ex = engine.executor
            saved, timed = ex.graphs, TimedGraph(engine.program.graph_module)
            ex.graphs = timed
            rid = start(engine, ctx, timed_steps + 1)
            dist.barrier()
            engine.step()  # warm the interpreter path
            per_step = []
            for _ in range(timed_steps):
                timed.totals.clear()
                dist.barrier()
                w0 = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - w0
                row = dict(timed.totals)
                row["engine"] = wall - row.pop("graph")
                row["step"] = wall
                per_step.append(row)
            ex.graphs = saved
            assert engine.scheduler.get(rid) is None
            median_step = sorted(per_step, key=lambda r: r["step"])[len(per_step) // 2]
            breakdown[name] = {k: v / layers for k, v in median_step.items()}
        # One layer's paged attention alone, at this rank's local length, both meshes interleaved.
        attn = {name: [] for name in engines}
        calls = {}
        for name, engine in engines.items():
            ex = engine.executor
            kspec = next(c for c in engine.program.caches if c.layer == 0 and c.role == "k")
            vspec = next(c for c in engine.program.caches if c.layer == 0 and c.role == "v")
            kc, vc = ex.caches[kspec.name], ex.caches[vspec.name]
            dcp = engine.mesh.dcp
            local = int(layout.local_len(ctx, engine.mesh.dcp_rank(rank), dcp))
            table = torch.arange(-(-local // BLOCK), dtype=torch.int32).view(1, -1)
            q = torch.randn(1, heads[name], kc.shape[-1]).to(dtype)
            args = (q, kc, vc, table, torch.tensor([0, 1], dtype=torch.int32),
                    torch.tensor([local], dtype=torch.int32), None, kc.shape[-1] ** -0.5)
            calls[name] = args
            torch.ops.dcpgraph.paged_attention(*args)
        dist.barrier()
        for _ in range(attn_reps):
            for name, args in calls.items():
                c0 = time.thread_time()
                torch.ops.dcpgraph.paged_attention(*args)
                attn[name].append(time.thread_time() - c0)
        results["contexts"][ctx] = {
            "step_wall": step_wall, "step_cpu": step_cpu, "attn": attn, "breakdown": breakdown,
            "local_len": {name: int(layout.local_len(ctx, e.mesh.dcp_rank(rank), e.mesh.dcp)) for name, e in engines.items()},
        }
    return results


def step_target(ctx: int, ratio: float) -> tuple[str, bool, str] | None:
    """The target (docs/benchmarks.md) for the dcp=2/dcp=1 step ratio at ``ctx``, or None below 16K."""
    if ctx < STEP_TARGET_FROM:
        return None
    limit = STEP_TARGET_LONG[1] if ctx >= STEP_TARGET_LONG[0] else 1.0
    rule = f"dcp=2 step ≤ {limit} × dcp=1 at {ctx} tokens"
    return rule, ratio <= limit, f"{ratio:.2f} × dcp=1 ({ratio / limit - 1:.0%} over)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                        help="model dtype (bf16: the AMX attention path; results go to decode_scaling_bf16.json)")
    parser.add_argument("--contexts", type=int, nargs="+", default=None)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(DEFAULT_VARIANTS),
                        help=f"meshes to compare (default: {' '.join(DEFAULT_VARIANTS)}; {BASELINE} is always run)")
    args = parser.parse_args(argv)
    from dcpgraph.runtime.distributed import spawn

    contexts = list(args.contexts or (QUICK_CONTEXTS if args.quick else FULL_CONTEXTS))
    layers = args.layers
    steps, warm, rounds, attn_reps, timed_steps = (4, 1, 2, 5, 3) if args.quick else (10, 2, 2, 9, 5)
    start = time.perf_counter()
    load_before = common.load_note()
    names = [BASELINE, *(n for n in args.variants if n != BASELINE)]
    variants = {n: VARIANTS[n] for n in names}
    ranks = spawn(worker, TP, contexts, layers, variants, steps, warm, rounds, attn_reps, timed_steps, args.dtype,
                  timeout_s=3600)
    r0 = ranks[0]
    load = common.load_note()
    records = []
    print(f"query heads per rank in the attention op: {r0['heads']}  (load before: {load_before}, after: {load})")
    print(f"lowering built per mesh: {r0['comm']}")
    for name, reason in r0["comm_choice"].items():
        print(f"{name}: comm=auto chose {reason}")
    print(f"{'context':>8} " + " ".join(f"{'step ' + n:>14}" for n in names) + "  ratios to dcp1   "
          + " ".join(f"{'attn ' + n:>14}" for n in names))
    for ctx in contexts:
        c = r0["contexts"][ctx]
        step = {n: statistics.median(c["step_wall"][n]) * 1e3 for n in names}
        step_cpu = {n: statistics.median(c["step_cpu"][n]) * 1e3 for n in names}
        attn = {n: statistics.median(c["attn"][n]) * 1e3 for n in names}
        attn_r1 = {n: statistics.median(ranks[1]["contexts"][ctx]["attn"][n]) * 1e3 for n in names}
        for n in names:
            dcp, comm, fuse = variants[n]
            built = r0["comm"][n]
            config = (f"qwen3 L={layers} hq=8 hkv=1 d=128 {args.dtype} tp={TP} dcp={dcp} comm={built} requested={comm} "
                      f"new_tokens={'fused' if fuse else 'split'} variant={n} gloo ctx={ctx} "
                      f"local_len={c['local_len'][n]} heads_in_op={r0['heads'][n]} {load}")
            base = {} if n == BASELINE else {"baseline": step[BASELINE]}
            rec = common.record(NAME, config, "decode_step_time", step[n], "ms", digits=4, **base)
            target = step_target(ctx, step[n] / step[BASELINE]) if n != BASELINE else None
            if target:
                common.with_target(rec, *target)
            records.append(rec)
            records.append(common.record(NAME, config, "decode_step_cpu_time", step_cpu[n], "ms", digits=4,
                                         **({} if n == BASELINE else {"baseline": step_cpu[BASELINE]})))
            rec = common.record(NAME, config, "decode_attention_time", attn[n], "ms", digits=4,
                                **({} if n == BASELINE else {"baseline": attn[BASELINE]}), rank1_ms=round(attn_r1[n], 4))
            if n != BASELINE and ctx == max(contexts):
                ratio = attn[n] / attn[BASELINE]
                common.with_target(rec, f"attention ≤ {ATTENTION_TARGET} × dcp=1 at the longest context",
                                   ratio <= ATTENTION_TARGET, f"{ratio:.2f} × dcp=1 ({ratio / ATTENTION_TARGET - 1:.0%} over)")
            records.append(rec)
            for part in PARTS:
                records.append(common.record(NAME, config, f"breakdown_{part.replace(' ', '_')}",
                                             c["breakdown"][n].get(part, 0.0) * 1e3, "ms per layer", digits=3))
        print(f"{ctx:>8} " + " ".join(f"{step[n]:>12.2f}ms" for n in names) + "  "
              + " ".join(f"{step[n] / step[BASELINE]:.2f}" for n in names[1:]) + "  "
              + " ".join(f"{attn[n]:>12.3f}ms" for n in names))
    print(f"\nper layer (ms; a part's time per step / {layers} layers, rank 0's median timed step; nodes timed one by "
          "one, so 'other ops' includes the interpreter's own cost):")
    print(f"{'part':>26} " + " ".join(f"{f'{ctx // 1024}K {n}':>13}" for ctx in contexts for n in names))
    for part in (*PARTS, "step"):
        print(f"{part:>26} " + " ".join(f"{r0['contexts'][ctx]['breakdown'][n].get(part, 0.0) * 1e3:>13.3f}"
                                         for ctx in contexts for n in names))
    for r in records:
        if "target" in r:
            comm = r["config"].split(" comm=")[1].split()[0]
            variant = r["config"].split(" variant=")[1].split()[0]
            print(f"target ({variant}, comm={comm}): {r['target']}: {r['ratio']:.2f} "
                  f"({'MET' if r['met'] else 'MISSED: ' + r['miss']})")
    out = common.write(NAME if args.dtype == "fp32" else f"{NAME}_{args.dtype}", records)
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
