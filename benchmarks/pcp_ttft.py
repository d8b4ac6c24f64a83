"""Time to first token of a long prompt with prefill context parallelism, pcp=1 vs pcp=2 (and any
``--pcp`` sizes; tp=1), beside the planner's prediction.

Each rank is a real gloo process running the eager PCP prefill (:mod:`dcpgraph.pcp.eager`) of one
``--tokens`` prompt (or, with ``--engine llm``, ``dcpgraph.LLM`` with ``prefill_context_parallel_size``
generating one token: the compiled engine and its worker processes, the prompt in one prefill step) through a seeded random Llama (``--layers`` layers, hidden 512, 8 query heads
of 64, 2 KV heads, MLP 1408, ``--dtype``). TTFT is, per rep, the slowest rank's wall time from a
barrier to the first token's logits (all K/V exchanges and the logits' share included). Variants,
interleaved rep by rep:

* ``pcp1_t{N}``: one process with N torch threads (N = the machine's cores: the baseline that uses
  the whole machine; and 1 thread, for the per-core view);
* ``pcp{P}``: P processes of one thread each (``--pcp``, default 2: the same cores).

Reported beside the times: prefill attention FLOPs (``4·Hq·D·Σ_i (i+1)`` per layer, the QKᵀ and PV
products over causal keys; per rank under PCP, from the zigzag split), the bytes each rank receives
in the per-layer K/V all-gather (``(pcp−1)/pcp·n·2·Hkv·D·itemsize`` per layer), and the load average
before and after (the machine is shared). Beside each one-thread-per-rank time, the planner's
TTFT (:func:`dcpgraph.plan.prefill_cost.prefill_estimate`: the busiest rank's dense + attention
FLOPs ÷ ``compute_flops``, plus the K/V exchange bytes ÷ link bandwidth and a latency per layer) on
``--hardware`` (default ``this-machine``: the planner's own calibration of this CPU and of a gloo
link, measured once before the runs), and the measured ÷ predicted ratio. Target: TTFT at pcp=2 ≤ 0.65× pcp=1 (all cores) at 8K.

    python benchmarks/pcp_ttft.py                       # 8K and 16K tokens, bf16, 8 layers
    python benchmarks/pcp_ttft.py --tokens 2048 --dtype float32 --reps 1   # a quick look
    python benchmarks/pcp_ttft.py --tokens 4096 --pcp 2 4 --hardware h200   # pcp 4, a preset's figures
    python benchmarks/pcp_ttft.py --engine llm --tokens 8192    # the compiled engine, through dcpgraph.LLM
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import time

from common import record, with_target, write

SHAPE = dict(vocab_size=1024, hidden_size=512, intermediate_size=1408, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64)


def _rank(rank: int, world: int, tokens: int, layers: int, dtype: str, threads: int, reps: int) -> list[float]:
    import torch
    import torch.distributed as dist
    import transformers as tf

    from dcpgraph import Mesh
    from dcpgraph.pcp.distributed import new_rank_groups, run_distributed
    from dcpgraph.pcp.eager import RankCache, prefill_rank

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = tf.LlamaConfig(**SHAPE, num_hidden_layers=layers, max_position_embeddings=max(tokens, 4096))
    model = tf.LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    mesh = Mesh(tp=1, dcp=1, pcp=world)
    groups = new_rank_groups(mesh, rank)
    ids = torch.randint(0, SHAPE["vocab_size"], (tokens,), generator=torch.Generator().manual_seed(1))
    times = []
    with torch.no_grad():
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            run_distributed(prefill_rank(model, mesh, rank, ids, 0, RankCache()), groups)
            times.append(time.perf_counter() - start)
    return times


def _checkpoint(directory: str, tokens: int, layers: int, dtype: str) -> str:
    """The benchmark's seeded Llama as a model directory (``--engine llm``), with a tokenizer of its
    vocabulary."""
    import torch
    import transformers as tf

    from dcpgraph.testing.checkpoints import first_special_id, tiny_tokenizer

    special = first_special_id(SHAPE["vocab_size"])
    config = tf.LlamaConfig(**SHAPE, num_hidden_layers=layers, max_position_embeddings=max(tokens, 4096) + 16,
                            bos_token_id=special, eos_token_id=special + 2, pad_token_id=special)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).to(getattr(torch, dtype)).eval().save_pretrained(directory)
    tiny_tokenizer(SHAPE["vocab_size"]).save_pretrained(directory)
    return directory


def _llm_ttft(model_dir: str, tokens: int, pcp: int, threads: int, reps: int, out) -> None:
    """In a fresh process: ``LLM(model_dir, prefill_context_parallel_size=pcp)`` (its ``pcp`` worker
    processes take one thread each; at pcp=1 the engine runs here on ``threads``), the whole prompt
    in one prefill step, one token generated; after a short warm-up prompt, ``reps`` timings."""
    import torch

    torch.set_num_threads(threads)
    from dcpgraph import LLM, SamplingParams

    ids = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=1, temperature=0)
    with LLM(model_dir, prefill_context_parallel_size=pcp, max_num_batched_tokens=tokens, max_model_len=tokens + 8,
             max_num_seqs=1, enable_prefix_caching=False) as llm:
        llm.generate([{"prompt_token_ids": ids[:64]}], params)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], params)
            times.append(time.perf_counter() - start)
    out.put(times)


def llm_ttft(model_dir: str, tokens: int, pcp: int, threads: int, reps: int) -> list[float]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_llm_ttft, args=(model_dir, tokens, pcp, threads, reps, out))
    proc.start()
    while True:  # a child that dies before answering must not leave the benchmark waiting
        try:
            times = out.get(timeout=5)
            break
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"the LLM process for pcp={pcp} exited with code {proc.exitcode} before timing") from None
    proc.join(60)
    return times


def attention_flops(tokens: int, pcp: int, rank: int, layers: int) -> int:
    from dcpgraph.pcp.split import causal_work

    return 4 * SHAPE["num_attention_heads"] * SHAPE["head_dim"] * causal_work(tokens, pcp, rank) * layers


def exchange_bytes(tokens: int, pcp: int, layers: int, itemsize: int) -> float:
    return (pcp - 1) / pcp * tokens * 2 * SHAPE["num_key_value_heads"] * SHAPE["head_dim"] * itemsize * layers


def planner_ttft(tokens: int, pcp: int, layers: int, dtype: str, hw) -> tuple[float, float, float]:
    """The planner's (TTFT seconds, busiest rank's attention FLOPs, exchange bytes per rank) for
    the benchmark's model at (tp=1, pcp)."""
    from dcpgraph.plan.model_shape import from_config
    from dcpgraph.plan.prefill_cost import prefill_estimate

    shape = from_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPE,
                         "num_hidden_layers": layers, "torch_dtype": dtype})
    est = prefill_estimate(shape, hw, tp=1, pcp=pcp, prompt_tokens=tokens)
    return est.ttft_s, est.attention_flops, est.exchange_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--pcp", type=int, nargs="+", default=[2], help="PCP sizes beside pcp=1 (one thread a rank)")
    parser.add_argument("--hardware", default="this-machine",
                        help="the planner's hardware for the prediction: this-machine (measured here) or a preset")
    parser.add_argument("--engine", default="eager", choices=["eager", "llm"],
                        help="eager: the eager PCP prefill on gloo ranks (dcpgraph.pcp.eager); llm: dcpgraph.LLM "
                             "with prefill_context_parallel_size (the compiled engine users run, its workers)")
    parser.add_argument("--out", default=None, help="results file (default benchmarks/results/pcp_ttft.json)")
    args = parser.parse_args(argv)

    from dcpgraph.plan.calibration import get_hardware
    from dcpgraph.runtime.distributed import spawn

    hw = get_hardware(args.hardware)
    prefill = ", ".join(f"{8 * b}-bit linear {lin / 1e9:.1f} / attention {att / 1e9:.1f}"
                        for (b, lin), (_, att) in zip(hw.linear_flops, hw.prefill_attention_flops))
    print(f"planner hardware: {hw.name}: decode attention {hw.compute_flops / 1e9:.1f} GFLOP/s, prefill "
          f"{prefill or 'not calibrated'} GFLOP/s, "
          f"link {hw.link_bandwidth / 1e9:.2f} GB/s, {hw.link_latency_s * 1e6:.0f} us ({hw.source})", flush=True)

    cores = os.cpu_count() or 1
    itemsize = 2 if args.dtype == "bfloat16" else 4
    records, name = [], "pcp_ttft"
    load_before = os.getloadavg()[0]
    import tempfile

    scratch = tempfile.TemporaryDirectory(prefix="pcp_ttft_")
    for n in args.tokens:
        config = f"{n} tokens, {args.layers} layers, {args.dtype}" + (", LLM" if args.engine == "llm" else "")
        model_dir = (_checkpoint(os.path.join(scratch.name, str(n)), n, args.layers, args.dtype)
                     if args.engine == "llm" else None)
        ttft: dict[str, list[float]] = {}
        variants = [(f"pcp1_t{cores}", 1, cores), ("pcp1_t1", 1, 1), *((f"pcp{p}", p, 1) for p in args.pcp)]
        for _ in range(args.reps):  # interleaved: one rep of each variant in turn
            for label, world, threads in variants:
                if model_dir is not None:
                    ttft.setdefault(label, []).append(llm_ttft(model_dir, n, world, threads, 1)[0])
                else:
                    per_rank = spawn(_rank, world, n, args.layers, args.dtype, threads, 1, timeout_s=3600)
                    ttft.setdefault(label, []).append(max(t[0] for t in per_rank))
                print(f"{config}: {label} {ttft[label][-1]:.2f} s (load {os.getloadavg()[0]:.1f})", flush=True)
        for label, _, _ in variants:
            records.append(record(name, config, f"ttft_{label}", min(ttft[label]), "s"))
        if "pcp2" in ttft:
            base, pcp2 = min(ttft[f"pcp1_t{cores}"]), min(ttft["pcp2"])
            rec = record(name, config, "ttft_pcp2_over_pcp1", pcp2, "s", baseline=base)
            if n == 8192:
                rec = with_target(rec, "TTFT at pcp=2 <= 0.65x pcp=1 at 8K", pcp2 / base <= 0.65,
                                  f"ratio {pcp2 / base:.2f}")
            records.append(rec)
        for label, p in (("pcp1_t1", 1), *((f"pcp{p}", p) for p in args.pcp)):
            predicted, flops, moved = planner_ttft(n, p, args.layers, args.dtype, hw)
            measured = min(ttft[label])
            print(f"{config}: {label} measured {measured:.2f} s, planner {predicted:.2f} s "
                  f"(x{measured / predicted:.2f}); attention {flops / 1e9:.1f} GFLOP, exchange {moved / 1e6:.1f} MB "
                  "per rank", flush=True)
            records.append(record(name, config, f"planner_ttft_{label}", predicted, "s", baseline=measured))
            records.append(record(name, config, f"planner_attention_flops_{label}", flops, "FLOP"))
            records.append(record(name, config, f"planner_exchange_bytes_{label}", moved, "B"))
        records.append(record(name, config, "attention_flops_pcp1", attention_flops(n, 1, 0, args.layers), "FLOP"))
        records.append(record(name, config, "attention_flops_pcp2_max_rank",
                              max(attention_flops(n, 2, r, args.layers) for r in range(2)), "FLOP"))
        records.append(record(name, config, "exchange_bytes_pcp2_per_rank",
                              exchange_bytes(n, 2, args.layers, itemsize), "B"))
    records.append(record(name, "machine", "load_average_1min_before", load_before, ""))
    records.append(record(name, "machine", "load_average_1min_after", os.getloadavg()[0], ""))
    records.append(record(name, "machine", "cores", cores, ""))
    for rec in records:
        print(rec)
    print("wrote", write(name, records, args.out and __import__("pathlib").Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
