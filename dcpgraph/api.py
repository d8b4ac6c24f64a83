"""Public entry points: ``trace``, ``compile`` and ``explain``."""

from __future__ import annotations

from typing import Any

import torch

from .errors import ConfigError, UnsupportedModelError
from .mesh import Mesh
from .program import Program


def trace(model: torch.nn.Module, example_inputs=None) -> Program:
    """The model's forward as a functional FX Program with canonical attention nodes.

    HF transformers causal LMs go through the registered attention implementation; other
    ``nn.Module``s through SDPA or hand-written attention recognition. Raises
    :class:`UnsupportedModelError` for attention the pipeline cannot implement.
    """
    from .frontends import hf

    if hf.is_hf_model(model):
        program = hf.trace_hf(model, example_inputs)
    else:
        from .frontends import fx

        program = fx.trace_module(model, example_inputs)
    count = sum(
        1 for n in program.graph_module.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.dcpgraph.attention.default
    )
    if count == 0:
        raise UnsupportedModelError(f"{type(model).__name__}: no recognisable attention in the traced graph")
    if count != program.facts.num_layers:
        raise UnsupportedModelError(
            f"{type(model).__name__}: found {count} attention nodes for {program.facts.num_layers} layers; "
            "some attention was not recognised"
        )
    return program


def facts_of(model: torch.nn.Module | Program):
    if isinstance(model, Program):
        return model.facts
    from .frontends import hf

    if hf.is_hf_model(model):
        return hf.model_facts(model)
    from .frontends import fx

    return fx.module_facts(model)


def compile(  # noqa: A001 - the library's verb, like torch.compile
    model: torch.nn.Module,
    *,
    tp: int = 1,
    dcp: int = 1,
    interleave: int = 1,
    block_size: int = 16,
    max_model_len: int | None = None,
    comm: str = "auto",
    backend: Any = "auto",
    **options: Any,
):
    """Compile ``model`` for ``tp`` ranks with DCP groups of ``dcp``; returns an :class:`Engine`.

    ``model`` may also be a Program from :func:`trace`, so one trace serves many configurations.

    Options: ``plan`` (TP plan for plain modules), ``num_blocks`` / ``kv_cache_tokens`` /
    ``kv_cache_bytes_per_rank`` (cache size), ``max_batched_tokens`` (chunked-prefill budget,
    default 256), ``max_num_seqs`` (default 8), ``executor`` ("auto", "emulated",
    "distributed"), ``verify`` (run the verifier after every pass, default True),
    ``capture_limit`` (largest decode batch given a static-shape graph, default 32; 0 disables
    graph mode), ``enable_prefix_caching`` (default False: reuse the KV of full virtual blocks,
    ``block_size · dcp`` tokens, shared with earlier requests' prompt prefixes; the hash covers
    whole virtual blocks and the block table is shared by the DCP group, so a hit is valid on
    every DCP rank at once; counters in ``Engine.report()["prefix_cache"]``),
    ``enable_expert_parallel`` (default False: routed experts tensor-parallel, each rank a
    ``1/tp`` slice of every expert; True: experts partitioned over the TP ranks, see
    :mod:`dcpgraph.passes.tp_modules`).
    """
    from .passes.pipeline import compile_program
    from .runtime.engine import Engine, blocks_for_budget
    from .runtime.executors import DistributedExecutor, EmulatedExecutor

    mesh = Mesh(tp, dcp)
    if comm not in ("auto", "a2a", "ag_rs"):
        raise ConfigError(f"comm must be 'auto', 'a2a' or 'ag_rs', got {comm!r}")
    facts = facts_of(model)
    mesh.validate(
        attention=facts.attention, num_q_heads=facts.num_q_heads, num_kv_heads=facts.num_kv_heads,
        block_size=block_size, interleave=interleave,
    )
    executor = options.pop("executor", "auto")
    executor_cls = _executor_for(executor, mesh, EmulatedExecutor, DistributedExecutor)
    max_model_len = int(max_model_len or min(facts.extra.get("max_position_embeddings", 4096) or 4096, 4096))
    max_num_seqs = int(options.pop("max_num_seqs", 8))
    max_batched_tokens = int(options.pop("max_batched_tokens", 256))
    capture_limit = int(options.pop("capture_limit", 32))
    speculative_tokens = int(options.pop("speculative_tokens", 0))
    enable_prefix_caching = bool(options.pop("enable_prefix_caching", False))
    sizes = {k: options.pop(k, None) for k in ("num_blocks", "kv_cache_tokens", "kv_cache_bytes_per_rank")}
    if options.pop("enable_expert_parallel", False):
        from .passes.tp_styles import with_expert_parallel

        model = with_expert_parallel(model if isinstance(model, Program) else trace(model))
    program = compile_program(
        model, mesh, block_size=block_size, interleave=interleave, comm=comm,
        plan=options.pop("plan", None), verify=options.pop("verify", True),
    )
    if options:
        raise TypeError(f"unknown options: {sorted(options)}")
    if capture_limit < 0:
        raise ConfigError(f"capture_limit must be >= 0, got {capture_limit}")
    if speculative_tokens < 0:
        raise ConfigError(f"speculative_tokens must be >= 0, got {speculative_tokens}")
    num_blocks = blocks_for_budget(program, **sizes, max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    from .backends import compile_backend

    graphs = compile_backend(program, backend, distributed=executor_cls is DistributedExecutor)
    return Engine(
        program, executor_cls=executor_cls, num_blocks=num_blocks, max_model_len=max_model_len,
        max_batched_tokens=max_batched_tokens, max_num_seqs=max_num_seqs, graphs=graphs,
        capture_limit=capture_limit, enable_prefix_caching=enable_prefix_caching,
        speculative_tokens=speculative_tokens,
    )


def _executor_for(choice: str, mesh: Mesh, emulated, distributed):
    import torch.distributed as dist

    running = dist.is_available() and dist.is_initialized()
    if choice == "auto":
        if running and dist.get_world_size() == mesh.tp:
            return distributed
        return emulated
    if choice == "emulated":
        return emulated
    if choice == "distributed":
        if not running:
            raise ConfigError("executor='distributed' needs an initialised torch.distributed (e.g. torchrun)")
        if dist.get_world_size() != mesh.tp:
            raise ConfigError(f"torch.distributed world size {dist.get_world_size()} != tp={mesh.tp}")
        return distributed
    raise ConfigError(f"executor must be 'auto', 'emulated' or 'distributed', got {choice!r}")
