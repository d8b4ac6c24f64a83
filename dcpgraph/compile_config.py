"""What :func:`dcpgraph.compile` decides before tracing (:class:`CompileConfiguration`): the
checked options, the mesh validated against the model's facts (per attention layer), the executor,
the speculative draft's source, the refusals made by name before any pass or collective (PCP,
recurrent-state features, hybrid-cache options, expert parallelism without experts), and, once
the target is traced, whether prefix caching runs (:func:`prefix_caching_decided`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from .checkpoints.files import DTYPES
from .checkpoints.loader import load_program
from .config import DcpgraphConfig
from .errors import ConfigError
from .frontends.compressed_layers import compressed_layer_indices, prefix_block_misaligned
from .mesh import Mesh
from .pcp.support import refuse_pcp_compile
from .program import Program
from .recurrent_state import refuse_recurrent_state_features
from .runtime.executors import DistributedExecutor, EmulatedExecutor
from .runtime.layer_groups import check_hybrid_options
from .speculative.draft_model import check_draft
from .speculative.mtp import check_mtp_target
from .tracing import facts_of, trace


@dataclass(frozen=True)
class CompileConfiguration:
    """Everything :func:`compile` decides before tracing: the checked configuration (and its
    options by compile's names, ``opts``), the executor, the model's facts, the context length and
    the speculative draft's source (at most one of ``mtp_checkpoint`` and ``draft_program`` is set)."""

    settings: DcpgraphConfig
    mesh: Mesh
    opts: dict[str, Any]
    executor_cls: type
    facts: Any
    max_model_len: int
    mtp_checkpoint: Any = None
    draft_program: Program | None = None
    prefix_caching_off_reason: str | None = None  # why enable_prefix_caching=None was decided False

    @property
    def spec(self):
        return self.opts["speculative_config"]

    @property
    def distributed(self) -> bool:
        return self.executor_cls is DistributedExecutor


def configuration(model: torch.nn.Module | Program, settings: DcpgraphConfig) -> CompileConfiguration:
    """Checks the mesh against the model, the MTP target and the draft model, all before any
    tracing; ``max_model_len`` defaults to the model's ``max_position_embeddings``, at most 4096."""

    parallel = settings.parallel
    mesh = Mesh(parallel.tensor_parallel_size, parallel.decode_context_parallel_size,
                parallel.prefill_context_parallel_size)
    opts = settings.compile_options()
    executor_cls = executor_for(opts["executor"], mesh, EmulatedExecutor, DistributedExecutor)
    spec = opts["speculative_config"]
    facts = facts_of(model)
    validate_mesh(mesh, facts, opts)
    refuse_pcp_compile(mesh, facts, opts)
    max_model_len = int(opts["max_model_len"]
                        or min(facts.extra.get("max_position_embeddings", 4096) or 4096, 4096))
    if opts["hybrid_kv_cache"]:
        check_hybrid_options(enable_prefix_caching=opts["enable_prefix_caching"] is True, kv_allocation=opts["kv_allocation"],
                             draft_model=spec is not None and spec.method == "draft_model")
    if opts["enable_expert_parallel"] and not facts.extra.get("ep_plan"):
        raise ConfigError(f"enable_expert_parallel=True: {facts.architecture} has no expert-parallel plan "
                          "(no routed experts); use enable_expert_parallel=False")
    mtp_checkpoint = draft_program = None
    if spec is not None and spec.method == "mtp":
        mtp_checkpoint = check_mtp_target(facts, model)
    if spec is not None and spec.method == "draft_model":
        draft_program = draft_program_of(spec.model, facts.dtype)
        check_draft(facts, draft_program.facts, mesh, block_size=opts["block_size"], interleave=opts["interleave"],
                    max_model_len=max_model_len)
    return CompileConfiguration(settings, mesh, opts, executor_cls, facts, max_model_len, mtp_checkpoint, draft_program)


def validate_mesh(mesh: Mesh, facts, opts: dict[str, Any]) -> None:
    """The mesh against the model, per attention layer where the layers' KV heads differ."""
    mesh.validate(
        attention=facts.attention, num_q_heads=facts.num_q_heads, num_kv_heads=facts.num_kv_heads,
        block_size=opts["block_size"], interleave=opts["interleave"], layer_kv_heads=facts.layer_kv_heads,
    )


def executor_for(choice: str, mesh: Mesh, emulated, distributed):
    import torch.distributed as dist

    running = dist.is_available() and dist.is_initialized()
    if choice == "auto":
        if running and dist.get_world_size() == mesh.world_size:
            return distributed
        return emulated
    if choice == "emulated":
        return emulated
    if choice == "distributed":
        if not running:
            raise ConfigError("executor='distributed' needs an initialised torch.distributed (e.g. torchrun)")
        if dist.get_world_size() != mesh.world_size:
            raise ConfigError(f"torch.distributed world size {dist.get_world_size()} != tp·pcp={mesh.world_size} "
                              f"(tp={mesh.tp}, pcp={mesh.pcp})")
        return distributed
    raise ConfigError(f"executor must be 'auto', 'emulated' or 'distributed', got {choice!r}")


def draft_program_of(model, dtype: torch.dtype) -> Program:
    """The draft as a traced Program: a directory is loaded shard by shard (each rank reads its
    slices, :func:`~dcpgraph.checkpoints.loader.load_program`), an ``nn.Module`` is traced, a Program
    is used as is."""
    if isinstance(model, Program):
        return model
    if isinstance(model, str):
        return load_program(model, next((k for k, v in DTYPES.items() if v == dtype), "auto"))
    return trace(model)


def prefix_caching_refusal(program: Program, opts: dict[str, Any], dcp: int = 1) -> str | None:
    """Why prefix caching cannot run for the traced ``program`` under ``opts``, None when it can:
    compressed (DeepSeek-V4) layers whose cached blocks would not hold exactly their own entries
    (:func:`~.frontends.compressed_layers.prefix_block_misaligned`), or ``hybrid_kv_cache`` (a sliding layer's dropped blocks
    cannot serve a later hit). Recurrent layers and the compressors' open windows can: their state
    is kept at cached block boundaries (:mod:`.runtime.state_prefix_cache`)."""
    compressed = compressed_layer_indices(program)
    misaligned = compressed and prefix_block_misaligned(program, block_size=opts["block_size"], dcp=dcp,
                                                        interleave=opts.get("interleave", 1))
    if misaligned:
        return f"compressed attention layers {compressed[:8]}: {misaligned}"
    if opts["hybrid_kv_cache"]:
        return "hybrid_kv_cache: a sliding layer's dropped blocks cannot serve a later prefix hit"
    return None


def prefix_caching_decided(program: Program, config: CompileConfiguration) -> CompileConfiguration:
    """``enable_prefix_caching=None`` (vLLM's default, which LLM and serve pass) decided: on unless
    :func:`prefix_caching_refusal` names a reason, which the configuration keeps
    (``prefix_caching_off_reason``) for the engine's report. True and False stay as given."""
    if config.opts["enable_prefix_caching"] is not None:
        return config
    reason = prefix_caching_refusal(program, config.opts, config.mesh.dcp)
    return dataclasses.replace(config, opts={**config.opts, "enable_prefix_caching": reason is None},
                               prefix_caching_off_reason=reason)


def refuse_recurrent_state_options(program: Program, config: CompileConfiguration) -> None:
    """Refuse by name, before any pass or collective, a hybrid with MTP drafts, and a draft model
    with recurrent layers (options whose state is not kept)."""
    recurrent = program.facts.extra.get("recurrent_layers") or {}
    draft = config.draft_program
    draft_recurrent = (draft.facts.extra.get("recurrent_layers") or {}) if draft is not None else {}
    refuse_recurrent_state_features(sorted(recurrent), config.spec, sorted(draft_recurrent))
