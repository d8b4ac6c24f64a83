"""``dcpgraph serve MODEL_DIR``: the OpenAI-compatible server, flags in vLLM's spelling.

The flags are a thin map onto :class:`~dcpgraph.LLM`'s options (:func:`llm_options`); the model is
loaded and compiled (and the worker processes started) before the server listens.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from ..backends.registry import available_backends
from ..capacity import KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPES, canonical_kv_cache_dtype
from ..errors import ConfigError, DcpGraphError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dcpgraph serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="local HF model directory (config.json, safetensors weights, tokenizer)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1)
    p.add_argument("--cp-kv-cache-interleave-size", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="auto", help="auto (from the config), float32, bfloat16, float16, float64")
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="KV cache size in blocks per rank (default: max-num-seqs sequences of max-model-len)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV cache size in bytes per rank, scales included (instead of --num-gpu-blocks-override)")
    p.add_argument("--speculative-config", type=_json_object, default=None,
                   help='speculative decoding, vLLM\'s JSON: {"method": "ngram"|"draft_model"|"mtp", '
                        '"num_speculative_tokens": k, "model": DRAFT_DIR, "prompt_lookup_min"/"prompt_lookup_max": n}')
    p.add_argument("--kv-cache-dtype", default="auto", choices=(*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES),
                   help="KV cache element type: auto (the model's dtype), bf16, or fp8_e4m3 (one fp32 "
                        "power-of-two scale per token, KV head and 128 elements); vLLM's fp8 and "
                        "bfloat16 name the same")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="partition a MoE model's routed experts over the tensor-parallel ranks instead of "
                        "slicing every expert")
    p.add_argument("--hybrid-kv-cache", action="store_true",
                   help="sliding-window layers get their own block table and a pool sized for their window "
                        "(Gemma-2/3, GPT-OSS, Qwen3 hybrids: more requests in the same memory); not with "
                        "--enable-prefix-caching")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run the program eagerly: nothing is compiled at start-up (the 'eager' backend)")
    p.add_argument("--backend", default=None, choices=available_backends(),
                   help="dcpgraph's compiler backend (default auto: torchair on Ascend, inductor on CUDA, "
                        "eager on CPU); every decode bucket is compiled before the server listens")
    p.add_argument("--compile-cache-dir", default=None,
                   help="a directory that keeps compiled graphs across processes and restarts, so a second "
                        "start-up compiles from it")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("DCPGRAPH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $DCPGRAPH_API_KEY)")
    p.add_argument("--worker-host", default="127.0.0.1",
                   help="interface the driver-to-worker channels and the gloo world bind to")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20)
    p.add_argument("--kv-transfer-config", default=None,
                   help="P/D disaggregation, vLLM's keys as JSON, e.g. '{\"kv_role\": \"kv_producer\", \"kv_rank\": 0, "
                        "\"kv_parallel_size\": 2, \"kv_port\": 14579}' (see dcpgraph/serving/kv_connector/config.py)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def llm_options(args: argparse.Namespace) -> dict:
    options = dict(
        tensor_parallel_size=args.tensor_parallel_size, decode_context_parallel_size=args.decode_context_parallel_size,
        cp_kv_cache_interleave_size=args.cp_kv_cache_interleave_size, block_size=args.block_size,
        max_model_len=args.max_model_len, dtype=args.dtype, enable_prefix_caching=args.enable_prefix_caching,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        worker_host=args.worker_host,
    )
    if args.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = canonical_kv_cache_dtype(args.kv_cache_dtype)
    if args.enable_expert_parallel:
        options["enable_expert_parallel"] = True
    if args.hybrid_kv_cache:
        options["hybrid_kv_cache"] = True
    if args.enforce_eager and args.backend not in (None, "eager"):
        raise ConfigError(f"--enforce-eager runs the 'eager' backend; it contradicts --backend {args.backend}")
    if args.enforce_eager or args.backend is not None:
        options["backend"] = "eager" if args.enforce_eager else args.backend
    if args.compile_cache_dir is not None:
        options["compile_cache_dir"] = args.compile_cache_dir
    if args.speculative_config is not None:
        options["speculative_config"] = args.speculative_config
    if args.num_gpu_blocks_override is not None:
        options["num_blocks"] = args.num_gpu_blocks_override
    if args.kv_cache_memory_bytes is not None:
        options["kv_cache_bytes_per_rank"] = args.kv_cache_memory_bytes
    return options


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("dcpgraph.serving")
    import uvicorn

    from .api_server import build_app
    from .kv_connector import parse_kv_transfer_config
    from .kv_connector.agent import KVAgent
    from .llm import LLM

    try:
        kv_config = parse_kv_transfer_config(args.kv_transfer_config) if args.kv_transfer_config else None
        llm = LLM(model=args.model, **llm_options(args))
    except DcpGraphError as err:
        print(f"dcpgraph serve: {err}", file=sys.stderr)
        return 2
    try:
        kv_agent = KVAgent(kv_config, llm.engine) if kv_config else None
    except DcpGraphError as err:
        llm.shutdown()
        print(f"dcpgraph serve: {err}", file=sys.stderr)
        return 2
    if kv_agent:
        log.info("KV transfer: %s", kv_config.to_json())
    pids = llm.engine.worker_pids()
    if pids:
        log.info("worker processes (rank order): pids %s", pids)
    app = build_app(llm, served_model_name=args.served_model_name or args.model, api_key=args.api_key,
                    max_body_bytes=args.max_request_bytes, kv_agent=kv_agent)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run()
    finally:
        app.state.engine_loop.stop()
        llm.shutdown()
    return 0
