"""``dcpgraph plan MODEL_DIR_OR_ARCH --world-size N --hardware NAME ...``: print the plan.

MODEL_DIR_OR_ARCH is a local HF model directory (its config.json; no weights are read) or a
named architecture (``kimi-k2``, ``deepseek-v3``, ``deepseek-v3.2``, ``deepseek-v4-flash``, ``qwen3-235b-a22b``,
``llama-3.1-70b``), optionally with overrides: ``deepseek-v3:num_hidden_layers=4``.
"""

from __future__ import annotations

import argparse
import sys

from ..capacity import KV_CACHE_DTYPE_ALIASES, canonical_kv_cache_dtype
from ..errors import ConfigError
from .architectures import ARCHITECTURES
from .hardware import HARDWARE_NAMES
from .model_shape import KV_CACHE_DTYPES
from .planner import plan
from .render import render_json, render_table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dcpgraph plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL_DIR_OR_ARCH",
                   help=f"local HF model directory or one of {sorted(ARCHITECTURES)}")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks (devices) in all (default: --nnodes x --gpus-per-node)")
    p.add_argument("--nnodes", type=int, default=1, help="machines the world spans (vLLM's name); ranks are "
                                                         "numbered node by node")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="devices per node (default: world-size / nnodes); a TP group spanning nodes pays the "
                        "inter-node link")
    p.add_argument("--hardware", default="h200", help=f"one of {list(HARDWARE_NAMES)}")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--kv-cache-memory-bytes", type=int, help="KV cache bytes per rank")
    budget.add_argument("--gpu-memory-utilization", type=float,
                        help="fraction of device memory for weights + KV")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-dtype", default="auto", choices=(*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES),
                   help="vLLM's fp8 and bfloat16 name fp8_e4m3 and bf16")
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--context-len", type=int, default=None, help="workload context (default max-model-len)")
    p.add_argument("--concurrency", type=int, default=None, help="requests decoding at once (default: all that fit)")
    p.add_argument("--weight-dtype-bytes", type=float, default=None,
                   help="bytes per weight: 2 bf16, 1 fp8, 0.5 int4 (default: the model's dtype)")
    p.add_argument("--experts", default="sharded", choices=["sharded", "replicated"],
                   help="routed experts split over tp (tensor or expert parallel, as dcpgraph, vLLM and SGLang "
                        "compile them) or replicated on every rank (for comparison)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="add the prefill table: TTFT of one prompt of this many tokens per (tp, pcp) layout")
    p.add_argument("--pcp", type=int, nargs="+", default=None, metavar="P",
                   help="prefill context parallel sizes for the prefill table (default: every divisor of the "
                        "world; implies --prompt-len = --context-len when --prompt-len is not given)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = plan(args.model, world_size=args.world_size, hardware=args.hardware,
                      kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                      gpu_memory_utilization=args.gpu_memory_utilization, block_size=args.block_size,
                      kv_cache_dtype=canonical_kv_cache_dtype(args.kv_cache_dtype), max_model_len=args.max_model_len,
                      context_len=args.context_len, concurrency=args.concurrency,
                      weight_dtype_bytes=args.weight_dtype_bytes, experts=args.experts, nnodes=args.nnodes,
                      gpus_per_node=args.gpus_per_node, prompt_len=args.prompt_len,
                      pcp_sizes=tuple(args.pcp) if args.pcp else None)
    except (ConfigError, ValueError) as err:
        print(f"dcpgraph plan: {err}", file=sys.stderr)
        return 2
    print(render_json(result) if args.json else render_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
