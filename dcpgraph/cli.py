"""``python -m dcpgraph``: compile a model with TP+DCP on real gloo processes and generate.

With no arguments: a small Qwen3-architecture model with random weights (fixed seed, nothing
downloaded) at tp=2, dcp=2, interleave=1 across two local gloo processes. It prints the tokens,
whether they equal the unsharded model's own greedy ``generate``, and the KV bytes per rank
against tp-only.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import dcpgraph

from .models import build_model
from .plan.cli import main as plan_main
from .runtime.distributed import spawn
from .testing.generation import hf_greedy

DEFAULT_PROMPTS = "1,2,3,4,5,6,7,8,9,10,11;42;7,7,7"


def _parse_prompts(text: str) -> list[list[int]]:
    return [[int(t) for t in p.split(",") if t.strip()] for p in text.split(";") if p.strip()]


def _say(message: str) -> None:
    print(message, flush=True)


def _progress(step: int, produced: int, total: int, final: bool) -> None:
    bar = "#" * (30 * produced // max(total, 1))
    line = f"  rank 0: step {step:3d}  [{bar:<30}] {produced}/{total} tokens"
    if sys.stdout.isatty():
        print("\r" + line, end="\n" if final else "", flush=True)
    elif final or step % 8 == 0:
        print(line, flush=True)


def _rank_main(rank: int, world: int, args: argparse.Namespace, prompts: list[list[int]]):

    model = build_model(args.model, seed=args.seed, dtype=getattr(torch, args.dtype), layers=args.layers)
    engine = dcpgraph.compile(model, tp=args.tp, dcp=args.dcp, interleave=args.interleave,
                              block_size=args.block_size, comm=args.comm)
    for p in prompts:
        engine.add_request(p, args.max_new_tokens)
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    done = 0
    total = len(prompts) * args.max_new_tokens
    produced = 0
    while done < len(prompts):
        for rid, token, finished in engine.step():
            outputs[rid].append(token)
            produced += 1
            done += finished
        if rank == 0:
            _progress(engine.steps, produced, total, final=done == len(prompts))
    return [outputs[i] for i in range(len(prompts))], engine.memory_report(), engine.report()


def _subcommand(argv: list[str]):
    """The ``main`` of ``dcpgraph plan`` (the deployment planner), ``serve MODEL_DIR`` (the
    OpenAI-compatible server) or ``proxy --prefill URL --decode URL`` (the P/D front door);
    None for the demo. Imported on demand: ``serve`` and ``proxy`` need the ``[serve]`` extra
    (fastapi, uvicorn, httpx), which the demo and the planner do not."""
    if argv[:1] == ["plan"]:
        return plan_main
    if argv[:1] == ["serve"]:
        from .serving.cli import main as serve_main

        return serve_main
    if argv[:1] == ["proxy"]:
        from .serving.proxy import main as proxy_main

        return proxy_main
    return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dcpgraph", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3",
                        help="local HF model directory, or llama|qwen2|qwen3|deepseek_v2|deepseek_v3 (random weights)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dcp", type=int, default=2)
    parser.add_argument("--interleave", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--comm", default="auto", choices=["auto", "a2a", "ag_rs", "ag"])
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS, help="token ids: '1,2,3;4,5' (';' separates prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--layers", type=int, default=2, help="layers of a random-weight model")
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--emulate", action="store_true", help="run every rank in this process instead of gloo")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    subcommand = _subcommand(argv)
    if subcommand is not None:
        return subcommand(argv[1:])
    args = _parser().parse_args(argv)
    prompts = _parse_prompts(args.prompts)


    start = time.perf_counter()
    _say(f"dcpgraph {dcpgraph.__version__}: model={args.model} tp={args.tp} dcp={args.dcp} "
         f"interleave={args.interleave} comm={args.comm} dtype={args.dtype}")
    model = build_model(args.model, seed=args.seed, dtype=getattr(torch, args.dtype), layers=args.layers)
    facts = dcpgraph.api.facts_of(model)
    _say(f"  {facts.architecture}: {facts.num_layers} layers, {facts.num_q_heads} query heads, "
         f"{facts.num_kv_heads} KV head(s), {facts.attention.upper()} attention")
    try:
        dcpgraph.Mesh(args.tp, args.dcp).validate(
            attention=facts.attention, num_q_heads=facts.num_q_heads, num_kv_heads=facts.num_kv_heads,
            block_size=args.block_size, interleave=args.interleave, layer_kv_heads=facts.layer_kv_heads)
    except dcpgraph.ConfigError as err:
        _say(f"configuration refused: {err}")
        return 2

    _say("  reference: the unsharded model's own greedy generate ...")
    reference = [hf_greedy(model, p, args.max_new_tokens) for p in prompts]

    if args.emulate:
        _say(f"  running {args.tp} ranks in one process (SPMD emulator) ...")
        results = [_rank_main(0, 1, args, prompts)]
    else:
        _say(f"  spawning {args.tp} gloo processes (compile + generate on every rank) ...")
        results = spawn(_rank_main, args.tp, args, prompts, timeout_s=600)
    tokens, memory, report = results[0]
    agree = all(r[0] == tokens for r in results)
    tp_only = dcpgraph.compile(model, tp=args.tp, dcp=1, block_size=args.block_size,
                               kv_cache_tokens=memory["kv_capacity_tokens"]).memory_report()
    same = _report(args, prompts, tokens, reference, memory, report, agree, tp_only)
    _say(f"  done in {time.perf_counter() - start:.1f} s")
    return 0 if same and agree else 1


def _report(args, prompts, tokens, reference, memory: dict, report: dict, agree: bool, tp_only: dict) -> bool:
    """Print each prompt's tokens against the reference and the KV memory against tp-only;
    returns whether every prompt's tokens equal the unsharded model's."""
    _say("")
    for i, (p, got, ref) in enumerate(zip(prompts, tokens, reference)):
        mark = "==" if got == ref else "!="
        _say(f"  prompt {i} ({len(p)} tokens) -> {got}")
        _say(f"      {mark} unsharded reference {ref}")
    same = all(g == r for g, r in zip(tokens, reference))
    _say("")
    _say(f"  executor: {report['executor']}, mesh: {report['mesh']}, merge: {report['comm']}, "
         f"ranks agree: {agree}")
    _say(f"  tokens equal to the unsharded model: {same}")
    _say(f"  KV cache per rank for {memory['kv_capacity_tokens']} tokens of context: "
         f"{memory['kv_bytes_per_rank'][0]:,} bytes with dcp={args.dcp} vs "
         f"{tp_only['kv_bytes_per_rank'][0]:,} bytes tp-only "
         f"({memory['kv_bytes_per_rank'][0] / tp_only['kv_bytes_per_rank'][0]:.3f}x)")
    _say(f"  KV bytes per token per rank: {memory['kv_bytes_per_token']:g} vs {tp_only['kv_bytes_per_token']:g}")
    return same


if __name__ == "__main__":
    sys.exit(main())
