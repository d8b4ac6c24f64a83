"""Public entry points: ``compile`` (and ``trace``, from :mod:`.tracing`), and the stages every
rank runs the same way: :func:`compile_programs` (configuration → traced, lowered programs, their
KV blocks and backend graphs: a :class:`CompiledModel`) and :func:`engine_for` (the engine that
schedules them). What is decided before tracing is :mod:`.compile_config`."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from .backends import backend_provenance, compile_backend, use_compile_cache_dir
from .backends.device_graphs import device_graphs_for
from .compile_config import (
    CompileConfiguration,
    configuration,
    prefix_caching_decided,
    prefix_caching_refusal,
    refuse_recurrent_state_options,
    validate_mesh,
)
from .config import CACHE_SIZE_OPTIONS, DcpgraphConfig
from .devices import resolve_device
from .errors import UnsupportedModelError
from .frontends.compressed_layers import refuse_compiling_compressed_layers
from .memory import (
    MemorySizing,
    agreed_blocks,
    default_utilization,
    ranks_sharing,
    size_for_utilization,
)
from .passes.insert_kv_cache import has_attention
from .passes.pipeline import compile_program
from .passes.shard_dcp_auto import compile_workload
from .program import Program
from .runtime.engine import Engine, blocks_for_budget
from .speculative.mtp_module import load_mtp_program
from .tracing import facts_of, trace, traced_program

__all__ = ["CompiledModel", "compile", "compile_programs", "engine_for", "facts_of", "placed",
           "prefix_caching_refusal", "program_device", "trace"]

log = logging.getLogger("dcpgraph")


def compile(  # noqa: A001 - the library's verb, like torch.compile
    model: torch.nn.Module | Program,
    *,
    tp: int = 1,
    dcp: int = 1,
    pcp: int = 1,
    interleave: int = 1,
    block_size: int = 16,
    max_model_len: int | None = None,
    comm: str = "auto",
    backend: Any = "auto",
    **options: Any,
):
    """Compile ``model`` for ``tp`` ranks with DCP groups of ``dcp``; returns an :class:`Engine`.

    ``pcp`` (prefill context parallel, vLLM's ``prefill_context_parallel_size``) is validated with
    the mesh (:meth:`dcpgraph.mesh.Mesh.validate`); with pcp > 1 the world is ``tp·pcp`` ranks and
    each step's tokens are split over the PCP ranks (:mod:`dcpgraph.passes.split_pcp_prefill`); what
    pcp > 1 does not run is refused by :func:`dcpgraph.pcp.support.refuse_pcp_compile`.

    ``model`` may also be a Program from :func:`trace`, so one trace serves many configurations.

    Options: ``plan`` (TP plan for plain modules), ``num_blocks`` / ``kv_cache_tokens`` /
    ``kv_cache_bytes_per_rank`` (cache size, at most one; without one, every sequence slot at
    ``max_model_len``; with ``kv_cache_space_bytes`` given, what those bytes buy, capped at every
    sequence slot at ``max_model_len`` only without prefix caching), ``max_num_batched_tokens`` (chunked-prefill
    budget, default 256), ``max_num_seqs`` (default 8), ``executor`` ("auto", "emulated",
    "distributed"), ``verify`` (run the verifier after every pass, default True),
    ``capture_limit`` (largest decode batch given a static-shape graph, default 32; 0 disables
    graph mode), ``cudagraph_mode`` (vLLM's name; ``"FULL_DECODE_ONLY"``, the default: on a CUDA
    device each static-shape bucket of a compiling backend is also captured as a CUDA graph and
    replayed, see :mod:`dcpgraph.backends.device_graphs`; ``"NONE"``: compiled buckets, no capture;
    nothing is captured on the CPU), ``speculative_config`` (vLLM's dict: ``{"method": "ngram" | "draft_model" | "mtp",
    "num_speculative_tokens": k, "model": draft dir/module/Program, "prompt_lookup_min"/"_max": n}``,
    see :mod:`dcpgraph.speculative`; a draft model, or with ``"mtp"`` the checkpoint's MTP layer (the
    target must then be a Program from :func:`dcpgraph.checkpoints.loader.load_program`), is compiled
    here on the same mesh, with its own KV cache of the same number of blocks), ``max_waiting`` (bound of
    the waiting queue, default 1024: past it ``add_request`` raises ``QueueFullError``),
    ``kv_allocation`` ("on_demand", the default: blocks as requests grow, preempting the youngest
    request when the cache is full; "whole_request": prompt + max new tokens reserved at admission),
    ``enable_prefix_caching`` (default False; None: on unless the model cannot run it, what
    :class:`~dcpgraph.LLM` and ``dcpgraph serve`` pass by default, see :func:`prefix_caching_refusal`;
    True: reuse the KV of full virtual blocks,
    ``block_size · dcp`` tokens, shared with earlier requests' prompt prefixes; the hash covers
    whole virtual blocks and the block table is shared by the DCP group, so a hit is valid on
    every DCP rank at once; counters in ``Engine.report()["prefix_cache"]``),
    ``enable_expert_parallel`` (default False: routed experts tensor-parallel, each rank a
    ``1/tp`` slice of every expert; True: experts partitioned over the TP ranks, see
    :mod:`dcpgraph.passes.tp_modules`), ``expert_replicas`` (default None; ``(D, d)`` with
    ``enable_expert_parallel``: replica ``d`` of ``D`` data-parallel replicas whose routed experts
    are partitioned over all ``D·tp`` ranks, run by worker processes that joined their EP group,
    see :mod:`dcpgraph.passes.experts_over_replicas`), ``kv_cache_dtype`` (vLLM's name: ``"auto"``, the
    model's dtype, default; ``"bf16"``; ``"fp8_e4m3"``, fp8 with one fp32 scale per token, head and
    128 elements, see :mod:`dcpgraph.ops.quant`; vLLM's ``"fp8"`` and ``"bfloat16"`` are taken as
    ``"fp8_e4m3"`` and ``"bf16"``), ``mlapo`` (default True: an MLA model's query/KV
    projections, norms, rotary and latent cache write become one ``mla_preprocess`` op per layer,
    bit-identical on CPU, a fused kernel on Ascend; False keeps them unfused; see
    :mod:`dcpgraph.passes.fuse_mla_preprocess`), ``hybrid_kv_cache`` (default False: every layer
    keeps a block per virtual block; True: sliding-window layers get their own block table and a
    pool sized for their window, see :mod:`dcpgraph.runtime.layer_groups`; not with prefix
    caching or ``kv_allocation="whole_request"``), ``compile_cache_dir`` (default None: inductor's
    own, under the temp directory; a path keeps compiled graphs there across processes, so a second
    start-up compiles from its cache; process-wide, as inductor's cache directory is),
    ``fuse_new_tokens`` (default None: True except on the Ascend backends; True: each layer reads
    its context and this step's new tokens in one paged read bounded by position, under DCP each
    rank the new tokens it owns; False: a separate new-token attention and a two-way merge, which
    FusedInferAttentionScore needs, see :mod:`dcpgraph.passes.fuse_new_tokens`), ``fuse_linears``
    (default False; True: linears that read one input, such as q/k/v and gate/up, run as one
    linear over each rank's weights concatenated, then slices, the same values up to fp rounding;
    see :mod:`dcpgraph.passes.fuse_linears`).

    A compiling backend compiles every decode bucket and the mixed graph before ``compile``
    returns (:mod:`dcpgraph.runtime.capture`): no request waits for a compile. Times per graph and
    a count of compiles after start-up are in ``Engine.report()["compile"]``.

    Deprecated spellings (a ``DeprecationWarning`` names the new one): ``max_batched_tokens``
    (``max_num_batched_tokens``), ``speculative_tokens=k`` (``speculative_config={"method":
    "ngram", "num_speculative_tokens": k}``); see :mod:`dcpgraph.options`.

    Every argument is checked (names, types, ranges, exclusive cache sizes, the mesh against the
    model) before any tracing, pass or collective runs.
    """

    return engine_for(compile_programs(model, tp=tp, dcp=dcp, pcp=pcp, interleave=interleave, block_size=block_size,
                                       max_model_len=max_model_len, comm=comm, backend=backend, **options))


@dataclass(frozen=True)
class CompiledModel:
    """What every rank runs, before any cache or scheduler exists: the lowered target, its KV blocks
    per rank, its backend graphs, the draft's ``(program, graphs)`` (None without one), and the
    checked configuration they were built from. Built the same way on every rank of a world
    (the comm choice's link measurement is collective), so ranks that build it from one
    configuration hold the same programs."""

    program: Program
    num_blocks: int
    graphs: Any
    draft: tuple[Program, Any] | None
    config: CompileConfiguration
    memory_sizing: MemorySizing | None = None  # how num_blocks came from gpu_memory_utilization, if it did


def compile_programs(model: torch.nn.Module | Program, *, ranks_on_host: int | None = None,
                     **options: Any) -> CompiledModel:
    """:func:`compile`'s work up to the engine: configuration → program → lowered programs and graphs.
    ``ranks_on_host``: the ranks sharing this host's memory, when the deployment knows them
    (``dcpgraph serve``'s workers; see :func:`dcpgraph.memory.ranks_sharing`)."""
    if not isinstance(model, (torch.nn.Module, Program)):
        raise TypeError(f"compile takes an nn.Module or a Program from dcpgraph.trace, not {type(model).__name__}")
    config = configuration(model, DcpgraphConfig.from_compile_options(**options))
    refuse_compiling_compressed_layers(model, tp=config.mesh.tp, dcp=config.mesh.dcp, pcp=config.mesh.pcp,
                                       opts=config.opts)
    program = placed(traced_program(model), config.opts["device"])
    validate_mesh(config.mesh, program.facts, config.opts)  # the graph's per-layer KV heads, before any pass
    config = prefix_caching_decided(program, config)
    refuse_recurrent_state_options(program, config)
    comm_workload = _comm_workload(program, config)
    program = _lowered_program(program, config, comm_workload)
    if program.recurrent_states:  # every rank (a distributed world's followers too) sizes the same pools
        slots = config.opts["max_num_seqs"]  # and as many snapshot rows under speculation (state_rollback)
        program = program.replace(lowering=program.lowering.decided(
            state_slots=slots, state_snapshots=slots if config.spec is not None else None,
            state_prefix_rows=slots if config.opts["enable_prefix_caching"] else None))
    num_blocks, sizing = _num_blocks(program, config, ranks_on_host)
    graphs = _compiled_graphs(program, config)
    return CompiledModel(backend_provenance(program, graphs), num_blocks, graphs,
                         _compiled_draft(config, comm_workload), config, sizing)


def engine_for(compiled: CompiledModel, executor_cls=None) -> Engine:
    """The engine that schedules ``compiled``; its executors are ``executor_cls`` (default: the
    configuration's choice) made as ``executor_cls(program, num_blocks, graphs)``."""
    config, opts = compiled.config, compiled.config.opts
    return Engine(
        compiled.program, executor_cls=executor_cls or config.executor_cls, num_blocks=compiled.num_blocks,
        max_model_len=config.max_model_len, max_batched_tokens=opts["max_num_batched_tokens"],
        max_num_seqs=opts["max_num_seqs"], graphs=compiled.graphs, capture_limit=opts["capture_limit"],
        enable_prefix_caching=opts["enable_prefix_caching"], speculative_config=config.spec, draft=compiled.draft,
        max_waiting=opts["max_waiting"], kv_allocation=opts["kv_allocation"], memory_sizing=compiled.memory_sizing,
        seed=opts["seed"], prefix_caching_off_reason=config.prefix_caching_off_reason,
    )


def _comm_workload(program: Program, config: CompileConfiguration):
    """The workload ``comm="auto"`` picks DCP's collectives for; None when there is no choice to
    make (an explicit ``comm``, or no DCP)."""
    opts = config.opts
    if opts["comm"] != "auto" or config.mesh.dcp == 1:
        return None

    return compile_workload(program, tp=config.mesh.tp, distributed=config.distributed, backend=opts["backend"],
                            max_model_len=config.max_model_len, max_num_seqs=opts["max_num_seqs"],
                            cache_size={k: opts[k] for k in CACHE_SIZE_OPTIONS})


def _lowered_program(program: Program, config: CompileConfiguration, comm_workload) -> Program:
    """The target through the pass pipeline, with the passes its configuration asks for (expert
    parallelism, MTP's hidden states, the hybrid cache's layer-group tables)."""

    opts = config.opts
    if not has_attention(program):  # before any pass: the pipeline's requirements would fail in absorb_mla
        raise UnsupportedModelError(
            f"{program.facts.architecture}: no attention layer was recognised in the traced graph "
            "(canonicalize_attention rewrote no attention call into dcpgraph.attention), so there is no KV "
            "cache to place: this model's attention form is not supported yet")
    return compile_program(
        program, config.mesh, block_size=opts["block_size"], interleave=opts["interleave"], comm=opts["comm"],
        plan=opts["plan"], verify=opts["verify"], kv_cache_dtype=opts["kv_cache_dtype"], mlapo=opts["mlapo"],
        return_hidden=config.mtp_checkpoint is not None, comm_workload=comm_workload,
        fuse_new=opts["fuse_new_tokens"], expert_parallel_experts=opts["enable_expert_parallel"],
        hybrid_kv_cache=opts["hybrid_kv_cache"], fuse_linears=opts["fuse_linears"],
        expert_replicas=tuple(opts["expert_replicas"]) if opts["expert_replicas"] is not None else None,
    )


def _num_blocks(program: Program, config: CompileConfiguration,
                ranks_on_host: int | None = None) -> tuple[int, MemorySizing | None]:
    """KV-cache blocks per rank: from the cache size given; else from ``gpu_memory_utilization``
    (given, or 0.9 on an accelerator; :func:`dcpgraph.memory.size_for_utilization`, the smallest
    count over the ranks of a distributed world), with its :class:`MemorySizing`; else the default
    budget: every sequence slot at ``max_model_len``; with ``kv_cache_space_bytes`` (LLM and serve
    on the host) the blocks that many bytes buy, no more than every sequence slot at
    ``max_model_len`` without prefix caching (a block past that is never used) and all of them with
    it (past that, blocks keep finished requests' prefixes for later hits, as vLLM's space does)."""

    opts, spec = config.opts, config.spec
    decode_tokens = 1 + (spec.num_speculative_tokens if spec else 0)
    explicit = any(opts[k] is not None for k in CACHE_SIZE_OPTIONS)
    device = program_device(program)
    utilization = None if explicit else default_utilization(device, opts["gpu_memory_utilization"])
    if utilization is not None:
        ranks = ranks_sharing(device, config.mesh.tp, distributed=config.distributed, ranks_on_host=ranks_on_host)
        sizing = size_for_utilization(program, utilization, device, ranks=ranks,
                                      max_num_batched_tokens=opts["max_num_batched_tokens"],
                                      max_num_seqs=opts["max_num_seqs"], max_model_len=config.max_model_len,
                                      decode_tokens=decode_tokens)
        agreed = agreed_blocks(sizing.num_blocks, device) if config.distributed else sizing.num_blocks
        sizing = dataclasses.replace(sizing, num_blocks=agreed)
        log.info("%s", sizing.describe())
        return sizing.num_blocks, sizing
    budget = {"max_model_len": config.max_model_len, "max_num_seqs": opts["max_num_seqs"],
              "decode_tokens": decode_tokens, "step_tokens": min(opts["max_num_batched_tokens"], config.max_model_len)}
    blocks = blocks_for_budget(program, **{k: opts[k] for k in CACHE_SIZE_OPTIONS}, **budget)
    if not explicit and opts["kv_cache_space_bytes"] is not None:
        space = blocks_for_budget(program, kv_cache_bytes_per_rank=opts["kv_cache_space_bytes"], **budget)
        blocks = space if opts["enable_prefix_caching"] else min(blocks, space)
    return blocks, None


def placed(program: Program, device: str) -> Program:
    """``program`` with the device its ranks run on (:attr:`Program.device`): ``device`` resolved
    (:func:`dcpgraph.devices.resolve_device`; a named accelerator the machine lacks is refused
    here, before any pass or collective). ``"auto"`` keeps an in-memory model where its parameters
    are and sends a checkpoint's (meta) state to the machine's accelerator, if any."""
    concrete = {t.device.type for t in program.state.values() if isinstance(t, torch.Tensor) and t.device.type != "meta"}
    if device == "auto" and concrete:
        return program
    kind = resolve_device(device).name
    if concrete == {kind} or (kind == "cpu" and not concrete):  # already there (a checkpoint is read to the host)
        return program
    return program.replace(device=kind)


def program_device(program: Program) -> torch.device:
    """Where ``program``'s ranks run: :attr:`Program.device` when set, else its state's device (the
    host when its state is on the meta device, as a checkpoint's is until each rank reads its
    slices)."""
    if program.device is not None:
        return torch.device(program.device)
    devices = {t.device for t in program.state.values() if isinstance(t, torch.Tensor) and t.device.type != "meta"}
    return devices.pop() if len(devices) == 1 else torch.device("cpu")


def _compiled_graphs(program: Program, config: CompileConfiguration):
    """The backend's graphs for ``program``, compiled now, in ``compile_cache_dir`` when given."""

    if config.opts["compile_cache_dir"] is not None:
        use_compile_cache_dir(config.opts["compile_cache_dir"])
    return compile_backend(program, config.opts["backend"], distributed=config.distributed,
                           device_graphs=device_graphs_for(program_device(program), config.opts["cudagraph_mode"]))


def _compiled_draft(config: CompileConfiguration, comm_workload):
    """``(program, graphs)`` of the speculative draft (a draft model or the checkpoint's MTP
    layer) on the target's mesh, or None without one."""

    draft_program = config.draft_program
    if config.mtp_checkpoint is not None:
        draft_program = load_mtp_program(config.mtp_checkpoint, config.facts, config.facts.dtype)
    if draft_program is None:
        return None
    opts = config.opts
    draft_program = compile_program(
        placed(draft_program, opts["device"]), config.mesh, block_size=opts["block_size"], interleave=opts["interleave"], comm=opts["comm"],
        verify=opts["verify"], kv_cache_dtype=opts["kv_cache_dtype"], comm_workload=comm_workload,
        fuse_new=opts["fuse_new_tokens"], fuse_linears=opts["fuse_linears"],
    )
    return draft_program, compile_backend(
        draft_program, opts["backend"], distributed=config.distributed,
        device_graphs=device_graphs_for(program_device(draft_program), opts["cudagraph_mode"]))

