"""Public entry points: ``trace``, ``compile`` and ``explain``."""

from __future__ import annotations

from typing import Any

import torch

from .errors import ConfigError, UnsupportedModelError
from .mesh import Mesh
from .options import CACHE_SIZE_OPTIONS, compile_options
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
    model: torch.nn.Module | Program,
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
    ``kv_cache_bytes_per_rank`` (cache size, at most one), ``max_batched_tokens`` (chunked-prefill
    budget, default 256), ``max_num_seqs`` (default 8), ``executor`` ("auto", "emulated",
    "distributed"), ``verify`` (run the verifier after every pass, default True),
    ``capture_limit`` (largest decode batch given a static-shape graph, default 32; 0 disables
    graph mode), ``speculative_tokens`` (draft tokens per decode step, default 0), ``max_waiting`` (bound of
    the waiting queue, default 1024: past it ``add_request`` raises ``QueueFullError``),
    ``kv_allocation`` ("on_demand", the default: blocks as requests grow, preempting the youngest
    request when the cache is full; "whole_request": prompt + max new tokens reserved at admission),
    ``enable_prefix_caching`` (default False: reuse the KV of full virtual blocks,
    ``block_size · dcp`` tokens, shared with earlier requests' prompt prefixes; the hash covers
    whole virtual blocks and the block table is shared by the DCP group, so a hit is valid on
    every DCP rank at once; counters in ``Engine.report()["prefix_cache"]``),
    ``enable_expert_parallel`` (default False: routed experts tensor-parallel, each rank a
    ``1/tp`` slice of every expert; True: experts partitioned over the TP ranks, see
    :mod:`dcpgraph.passes.tp_modules`), ``kv_cache_dtype`` (vLLM's name: ``"auto"``, the
    model's dtype, default; ``"bf16"``; ``"fp8_e4m3"``, fp8 with one fp32 scale per token, head and
    128 elements, see :mod:`dcpgraph.ops.quant`), ``compile_cache_dir`` (default None: inductor's
    own, under the temp directory; a path keeps compiled graphs there across processes, so a second
    start-up compiles from its cache; process-wide, as inductor's cache directory is).

    A compiling backend compiles every decode bucket and the mixed graph before ``compile``
    returns (:mod:`dcpgraph.runtime.capture`): no request waits for a compile. Times per graph and
    a count of compiles after start-up are in ``Engine.report()["compile"]``.

    Every argument is checked (names, types, ranges, exclusive cache sizes, the mesh against the
    model) before any tracing, pass or collective runs.
    """
    from .runtime.engine import Engine, blocks_for_budget
    from .runtime.executors import DistributedExecutor, EmulatedExecutor

    if not isinstance(model, (torch.nn.Module, Program)):
        raise TypeError(f"compile takes an nn.Module or a Program from dcpgraph.trace, not {type(model).__name__}")
    mesh = Mesh(tp, dcp)
    opts = compile_options(
        interleave=interleave, block_size=block_size, max_model_len=max_model_len, comm=comm,
        backend=backend, **options,
    )
    executor_cls = _executor_for(opts["executor"], mesh, EmulatedExecutor, DistributedExecutor)
    facts = facts_of(model)
    mesh.validate(
        attention=facts.attention, num_q_heads=facts.num_q_heads, num_kv_heads=facts.num_kv_heads,
        block_size=block_size, interleave=interleave,
    )
    max_model_len = int(max_model_len or min(facts.extra.get("max_position_embeddings", 4096) or 4096, 4096))
    from .passes.pipeline import compile_program

    program = model if isinstance(model, Program) else trace(model)
    if opts["enable_expert_parallel"]:
        from .passes.tp_styles import with_expert_parallel

        program = with_expert_parallel(program)
    program = compile_program(
        program, mesh, block_size=block_size, interleave=interleave, comm=comm,
        plan=opts["plan"], verify=opts["verify"], kv_cache_dtype=opts["kv_cache_dtype"],
    )
    sizes = {k: opts[k] for k in CACHE_SIZE_OPTIONS}
    num_blocks = blocks_for_budget(program, **sizes, max_model_len=max_model_len, max_num_seqs=opts["max_num_seqs"])
    from .backends import compile_backend, use_compile_cache_dir

    if opts["compile_cache_dir"] is not None:
        use_compile_cache_dir(opts["compile_cache_dir"])
    graphs = compile_backend(program, backend, distributed=executor_cls is DistributedExecutor)
    return Engine(
        program, executor_cls=executor_cls, num_blocks=num_blocks, max_model_len=max_model_len,
        max_batched_tokens=opts["max_batched_tokens"], max_num_seqs=opts["max_num_seqs"], graphs=graphs,
        capture_limit=opts["capture_limit"], enable_prefix_caching=opts["enable_prefix_caching"],
        speculative_tokens=opts["speculative_tokens"], max_waiting=opts["max_waiting"],
        kv_allocation=opts["kv_allocation"],
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
