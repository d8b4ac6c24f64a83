"""Decode step and attention time vs context, dcp=1 vs dcp=2, on real gloo processes (tp=2).

Model: a Qwen3 with 8 query heads and **1 KV head** of dim 128 (so tp=2 replicates the KV head
and dcp=2 is valid), hidden 256, 2 layers, fp32, random weights. Both meshes are compiled in the
same two ``spawn``-ed gloo processes (one thread each), with caches sized for the longest context.

**How the context gets there.** Prefilling 128K tokens through the model is needlessly slow on 2
cores (and what it writes does not matter for timing), so the caches are filled with random
values and each request is admitted with its prompt of ``C`` tokens marked as already computed
except the last (``request.computed = C − 1``): the first ``step()`` is then a decode step at
context ``C − 1`` whose token is written to its slot as usual, and every later step is an ordinary
decode step. Block tables come from the engine's own block manager (consecutive blocks here).

Per context length ``C`` (4K…128K; ``--quick``: 4K…16K), rounds interleave dcp=1 and dcp=2 (the
logical group names are re-registered for the engine about to run). Measured:

* ``decode_step_time``: median wall time of ``engine.step()`` on rank 0, each step started right
  after a barrier so both ranks begin together;
* ``decode_attention_time``: ``torch.ops.dcpgraph.paged_attention`` for one layer alone, on each
  rank's real cache at that rank's local length, with the query-head count of that mesh's graph
  (dcp=2 all-gathers the query heads of the DCP group), both ranks at once; median of rank 0's
  thread CPU time (so preemption by other jobs does not count); the ratio dcp2/dcp1 is the
  target (≤ 0.6 at the longest context);
* shares of the step (torch.profiler on rank 0 over a few steps): ``attention_share`` (paged +
  new-token attention ops), ``collective_share`` (every ``_c10d_functional`` op, ``wait_tensor``
  included, so waiting for the other rank counts here) and ``merge_share``
  (``merge_attention``/``rescale_to_global``), each as a fraction of the profiled steps' wall time.

Writes ``benchmarks/results/decode_scaling.json``; ``run.py`` plots it.

    python3 benchmarks/decode_scaling.py [--quick]
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
TP = 2
BLOCK = 16
TARGET = 0.6
FULL_CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)
QUICK_CONTEXTS = (4096, 8192, 16384)


def build_model():
    import transformers as tf

    cfg = tf.Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=1, head_dim=128,
                         max_position_embeddings=1 << 18, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def _attention_query_heads(program) -> int:
    for node in program.graph_module.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.dcpgraph.paged_attention.default:
            return int(node.args[0].meta["val"].shape[1])
    raise RuntimeError("no paged_attention node")


def _profile_shares(prof, wall: float) -> dict[str, float]:
    groups = {"attention": 0.0, "collective": 0.0, "merge": 0.0}
    for evt in prof.key_averages():
        name = evt.key
        us = evt.cpu_time_total
        if name in ("dcpgraph::paged_attention", "dcpgraph::partial_attention"):
            groups["attention"] += us
        elif name.startswith("_c10d_functional::"):
            groups["collective"] += us
        elif name in ("dcpgraph::merge_attention", "dcpgraph::rescale_to_global"):
            groups["merge"] += us
    return {k: v * 1e-6 / wall for k, v in groups.items()}


def worker(rank: int, world: int, contexts: list[int], steps: int, warm: int, rounds: int,
           attn_reps: int, prof_steps: int) -> dict:
    import torch.distributed as dist

    import dcpgraph
    from dcpgraph import layout
    from dcpgraph.runtime.distributed import register_mesh_groups

    torch.manual_seed(1234 + rank)
    longest = max(contexts)
    per_request = warm + steps
    program = dcpgraph.trace(build_model())
    engines = {}
    for dcp in (1, 2):
        engines[dcp] = dcpgraph.compile(
            program, tp=TP, dcp=dcp, block_size=BLOCK, backend="eager", max_num_seqs=1,
            max_batched_tokens=256, max_model_len=longest + per_request + prof_steps + 8,
            kv_cache_tokens=longest + per_request + prof_steps + 8, capture_limit=1,
        )
        for cache in engines[dcp].executor.caches.values():
            cache.normal_()
    heads = {dcp: _attention_query_heads(e.program) for dcp, e in engines.items()}
    gen = torch.Generator().manual_seed(0)
    prompt_all = torch.randint(0, 512, (longest,), generator=gen).tolist()

    def start(engine, ctx, n):
        rid = engine.add_request(prompt_all[:ctx], n)
        engine.scheduler.get(rid).computed = ctx - 1  # the context is "in the cache" (random values)
        return rid

    results: dict = {"heads": heads, "contexts": {}}
    for ctx in contexts:
        step_wall = {1: [], 2: []}
        step_cpu = {1: [], 2: []}
        for _ in range(rounds):
            for dcp, engine in engines.items():
                register_mesh_groups(engine.mesh)
                rid = start(engine, ctx, per_request)
                for i in range(per_request):
                    dist.barrier()
                    w0, c0 = time.perf_counter(), time.thread_time()
                    events = engine.step()
                    w1, c1 = time.perf_counter(), time.thread_time()
                    assert len(events) == 1
                    if i >= warm:
                        step_wall[dcp].append(w1 - w0)
                        step_cpu[dcp].append(c1 - c0)
                assert engine.scheduler.get(rid) is None  # finished and dropped
        # Shares of the step from a profile of rank 0 (rank 1 runs the same steps unprofiled).
        shares = {}
        for dcp, engine in engines.items():
            register_mesh_groups(engine.mesh)
            rid = start(engine, ctx, prof_steps + 1)
            dist.barrier()
            engine.step()
            dist.barrier()
            from torch.profiler import ProfilerActivity, profile

            if rank == 0:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    w0 = time.perf_counter()
                    for _ in range(prof_steps):
                        engine.step()
                    wall = time.perf_counter() - w0
                shares[dcp] = _profile_shares(prof, wall)
            else:
                for _ in range(prof_steps):
                    engine.step()
            assert engine.scheduler.get(rid) is None
        # One layer's paged attention alone, at this rank's local length, both meshes interleaved.
        attn = {1: [], 2: []}
        calls = {}
        for dcp, engine in engines.items():
            ex = engine.executor
            kspec = next(c for c in engine.program.caches if c.layer == 0 and c.role == "k")
            vspec = next(c for c in engine.program.caches if c.layer == 0 and c.role == "v")
            kc, vc = ex.caches[kspec.name], ex.caches[vspec.name]
            d = engine.mesh.dcp_rank(rank)
            local = int(layout.local_len(ctx, d, dcp))
            table = torch.arange(-(-local // BLOCK), dtype=torch.int32).view(1, -1)
            q = torch.randn(1, heads[dcp], kc.shape[-1])
            args = (q, kc, vc, table, torch.tensor([0, 1], dtype=torch.int32),
                    torch.tensor([local], dtype=torch.int32), None, kc.shape[-1] ** -0.5)
            calls[dcp] = args
            torch.ops.dcpgraph.paged_attention(*args)
        dist.barrier()
        for _ in range(attn_reps):
            for dcp, args in calls.items():
                c0 = time.thread_time()
                torch.ops.dcpgraph.paged_attention(*args)
                attn[dcp].append(time.thread_time() - c0)
        results["contexts"][ctx] = {
            "step_wall": step_wall, "step_cpu": step_cpu, "attn": attn, "shares": shares,
            "local_len": {dcp: int(layout.local_len(ctx, engines[dcp].mesh.dcp_rank(rank), dcp)) for dcp in engines},
        }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--contexts", type=int, nargs="+", default=None)
    args = parser.parse_args(argv)
    from dcpgraph.runtime.distributed import spawn

    contexts = list(args.contexts or (QUICK_CONTEXTS if args.quick else FULL_CONTEXTS))
    steps, warm, rounds, attn_reps, prof_steps = (4, 1, 2, 5, 3) if args.quick else (8, 2, 3, 9, 4)
    start = time.perf_counter()
    ranks = spawn(worker, TP, contexts, steps, warm, rounds, attn_reps, prof_steps, timeout_s=3600)
    r0 = ranks[0]
    load = common.load_note()
    records = []
    longest = max(contexts)
    print(f"query heads per rank in the attention op: {r0['heads']}  ({load})")
    print(f"{'context':>8} {'step dcp1':>10} {'step dcp2':>10} {'ratio':>6} {'attn dcp1':>10} {'attn dcp2':>10} "
          f"{'ratio':>6}  shares dcp1 / dcp2 (attention, collectives, merge)")
    for ctx in contexts:
        c = r0["contexts"][ctx]
        step = {d: statistics.median(c["step_wall"][d]) * 1e3 for d in (1, 2)}
        step_cpu = {d: statistics.median(c["step_cpu"][d]) * 1e3 for d in (1, 2)}
        attn = {d: statistics.median(c["attn"][d]) * 1e3 for d in (1, 2)}
        attn_r1 = {d: statistics.median(ranks[1]["contexts"][ctx]["attn"][d]) * 1e3 for d in (1, 2)}
        for d in (1, 2):
            config = (f"qwen3 L=2 hq=8 hkv=1 d=128 fp32 tp={TP} dcp={d} gloo ctx={ctx} "
                      f"local_len={c['local_len'][d]} heads_in_op={r0['heads'][d]} {load}")
            base = {} if d == 1 else {"baseline": step[1]}
            records.append(common.record(NAME, config, "decode_step_time", step[d], "ms", digits=4, **base))
            records.append(common.record(NAME, config, "decode_step_cpu_time", step_cpu[d], "ms", digits=4,
                                         **({} if d == 1 else {"baseline": step_cpu[1]})))
            rec = common.record(NAME, config, "decode_attention_time", attn[d], "ms", digits=4,
                                **({} if d == 1 else {"baseline": attn[1]}), rank1_ms=round(attn_r1[d], 4))
            if d == 2 and ctx == longest:
                ratio = attn[2] / attn[1]
                common.with_target(rec, f"≤ {TARGET} × dcp=1 at the longest context", ratio <= TARGET,
                                   f"{ratio:.2f} × dcp=1 ({ratio / TARGET - 1:.0%} over)")
            records.append(rec)
            for key, value in c["shares"][d].items():
                records.append(common.record(NAME, config, f"{key}_share", value * 100, "% of step", digits=3))
        s1, s2 = c["shares"][1], c["shares"][2]
        print(f"{ctx:>8} {step[1]:>9.2f}ms {step[2]:>9.2f}ms {step[2] / step[1]:>6.2f} {attn[1]:>9.3f}ms "
              f"{attn[2]:>9.3f}ms {attn[2] / attn[1]:>6.2f}  "
              f"{s1['attention']:.0%}/{s1['collective']:.0%}/{s1['merge']:.0%}  "
              f"{s2['attention']:.0%}/{s2['collective']:.0%}/{s2['merge']:.0%}")
    target = [r for r in records if "target" in r]
    for r in target:
        print(f"target: attention time dcp2/dcp1 at {longest} tokens = {r['ratio']:.2f} "
              f"({'MET' if r['met'] else 'MISSED: ' + r['miss']})")
    out = common.write(NAME, records)
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
