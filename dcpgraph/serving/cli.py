"""``dcpgraph serve MODEL_DIR``: the OpenAI-compatible server, flags in vLLM's spelling.

The flags are generated from the configuration's fields (:mod:`dcpgraph.config`); the
configuration they build is what :class:`~dcpgraph.LLM` is given (:func:`llm_options`); the
model is loaded and compiled (and the worker processes started) before the server listens.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..config import DcpgraphConfig
from ..errors import ConfigError, DcpGraphError
from ..memory import size_text
from ..mesh import Mesh
from ..pcp.support import refuse_pcp_execution
from .cli_args import add_cli_args


def build_parser() -> argparse.ArgumentParser:
    """``dcpgraph serve``'s parser: one flag per configuration field, generated
    (:func:`dcpgraph.serving.cli_args.add_cli_args`), so every flag is a field and every field a flag."""
    p = argparse.ArgumentParser(prog="dcpgraph serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_cli_args(p)


def llm_options(args: argparse.Namespace) -> dict:
    """:class:`~dcpgraph.LLM`'s keyword arguments (all but ``model``) for the parsed flags: the
    configuration they build (validated: ``--enforce-eager`` against ``--backend``, ...), in
    ``LLM``'s names (:func:`~.llm.llm_kwargs`)."""
    from .llm import llm_kwargs

    return llm_kwargs(DcpgraphConfig.from_cli_args(args))


def read_chat_template(value: str) -> str:
    """``--chat-template``: a file's contents, or the value itself when it is a Jinja template
    (vLLM's rule); anything else (a path that does not exist) is a ``ConfigError``."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def server_options(settings: DcpgraphConfig):
    """The server's own options from the flags."""
    from .api_server import ServerOptions

    serving = settings.serving
    template = read_chat_template(serving.chat_template) if serving.chat_template else None
    return ServerOptions(chat_template=template, max_logprobs=serving.max_logprobs,
                         log_stats=not serving.disable_log_stats, log_requests=serving.enable_log_requests,
                         reasoning_parser=serving.reasoning_parser,
                         auto_tool_parser=serving.tool_call_parser if serving.enable_auto_tool_choice else None)


def kv_sizing_line(memory: dict) -> str:
    """The start-up line naming the KV cache's size per rank and how it was chosen."""
    sizing = memory.get("kv_sizing", {})
    line = (f"{memory['num_blocks']} blocks per rank of {memory['block_size']} tokens, "
            f"{size_text(memory['kv_bytes_per_rank'][0])} per rank, {memory['kv_capacity_tokens']} tokens")
    if sizing.get("policy") != "gpu_memory_utilization":
        return line + (" (from the cache-size options or the default: $VLLM_CPU_KVCACHE_SPACE GiB, else 4 GiB, "
                       "at most max-num-seqs x max-model-len)")
    return (line + f" (--gpu-memory-utilization {sizing['utilization']}: {size_text(sizing['device_memory'])} "
            f"{sizing['device']} / {sizing['ranks_sharing']} ranks - {size_text(sizing['weight_bytes'])} weights "
            f"- {size_text(sizing['activation_peak_bytes'])} activation peak)")


def run_headless_node(settings: DcpgraphConfig) -> int:
    """``--headless``: check the model directory as the head does, then run this node's ranks until
    the head stops them (:func:`~.headless.run_headless`)."""
    from .headless import run_headless
    from .llm import checked_checkpoint
    from .nodes import NodeLayout

    checked = checked_checkpoint(settings, "serve")
    parallel = settings.parallel
    return run_headless(checked.config, NodeLayout.of(parallel), timeout_s=settings.serving.worker_timeout_s,
                        replicas=parallel.data_parallel_size, expert_parallel=parallel.enable_expert_parallel)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("dcpgraph.serving")
    import uvicorn

    from .api_server import build_app
    from .kv_connector import parse_kv_transfer_config
    from .kv_connector.agent import KVAgent
    from .kv_connector.replicas import ReplicaKVAgents, check_data_parallel_pd
    from .llm import LLM, llm_kwargs

    try:
        settings = DcpgraphConfig.from_cli_args(args)  # every flag checked, before any work
        if settings.parallel.headless:
            return run_headless_node(settings)
        serving = settings.serving
        options = server_options(settings)
        kv_config = parse_kv_transfer_config(serving.kv_transfer_config) if serving.kv_transfer_config else None
        if kv_config is not None:  # before any rank starts
            par = settings.parallel
            refuse_pcp_execution(Mesh(par.tensor_parallel_size, par.decode_context_parallel_size,
                                      par.prefill_context_parallel_size), kv_role=kv_config.kv_role)
            check_data_parallel_pd(kv_config, par.data_parallel_size)
        llm = LLM(model=settings.model.model, usage_context="serve", **llm_kwargs(settings))
    except DcpGraphError as err:
        print(f"dcpgraph serve: {err}", file=sys.stderr)
        return 2
    try:
        kv_agent = None
        if kv_config is not None:  # data parallelism: one agent (and rendezvous port) per replica
            replicated = settings.parallel.data_parallel_size > 1
            kv_agent = (ReplicaKVAgents if replicated else KVAgent)(kv_config, llm.engine)
    except DcpGraphError as err:
        llm.shutdown()
        print(f"dcpgraph serve: {err}", file=sys.stderr)
        return 2
    if kv_agent:
        log.info("KV transfer: %s", kv_config.to_json())
    log.info("KV cache: %s", kv_sizing_line(llm.engine.memory_report()))
    pids = llm.engine.worker_pids()
    if pids:
        log.info("worker processes (rank order): pids %s", pids)
    app = build_app(llm, served_model_name=serving.served_model_name or settings.model.model, api_key=serving.api_key,
                    max_body_bytes=serving.max_request_bytes, kv_agent=kv_agent, options=options)
    config = uvicorn.Config(app, host=serving.host, port=serving.port,
                            log_level=serving.uvicorn_log_level or serving.log_level,
                            timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run()
    finally:
        app.state.engine_loop.stop()
        llm.shutdown()
    return 0
