"""What an engine is built from: a JSON-able record, the same on the driver and on every rank."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..api import CompiledModel, compile_programs, engine_for
from ..checkpoints.loader import load_program


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str  # resolved (never "auto"), a key of checkpoint.DTYPES
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1  # the world is tp·pcp ranks (dcpgraph.mesh.Mesh)
    cp_kv_cache_interleave_size: int = 1
    block_size: int = 16
    max_model_len: int = 4096
    enable_prefix_caching: bool = False
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    engine_options: dict[str, Any] = field(default_factory=dict)  # more dcpgraph.compile options
    # ranks sharing one node's host memory (data-parallel replicas included): what a memory
    # fraction of the host is divided by (None: dcpgraph.memory.ranks_sharing's default)
    ranks_on_host: int | None = None
    load_format: str = "auto"  # "dummy": random weights from the config (see checkpoints.loader.load_program)
    # data-parallel replicas sharing the routed experts: [host, port, EP size, this replica's index];
    # every rank joins the EP group through the TCP store at host:port (None: no such group)
    expert_group: list | None = None

    @property
    def device(self) -> str:
        """The device kind every rank runs on, as the front end resolved it ("cpu" when not set)."""
        return self.engine_options.get("device", "cpu")

    @property
    def world_size(self) -> int:
        """Ranks of one engine: ``tensor_parallel_size · prefill_context_parallel_size``."""
        return self.tensor_parallel_size * self.prefill_context_parallel_size

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> EngineConfig:
        return cls(**data)


def compile_rank(config: EngineConfig, executor: str = "auto") -> CompiledModel:
    """Trace the checkpoint's model on the meta device and compile it (no weights are read here:
    an executor reads its ranks' slices, :func:`~dcpgraph.checkpoints.loader.load_program`).
    Inside an initialised world of size ``tp·pcp`` (a worker, or torchrun) every rank calls it, and
    "auto" picks the distributed executor."""
    program = load_program(config.model, config.dtype, config.load_format, config.device)
    return compile_programs(
        program, tp=config.tensor_parallel_size, dcp=config.decode_context_parallel_size,
        pcp=config.prefill_context_parallel_size, interleave=config.cp_kv_cache_interleave_size, block_size=config.block_size,
        max_model_len=config.max_model_len, enable_prefix_caching=config.enable_prefix_caching,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        executor=executor, ranks_on_host=config.ranks_on_host, **config.engine_options,
    )


def build_engine(config: EngineConfig, executor: str = "auto"):
    """An :class:`~dcpgraph.Engine` on this process for ``config`` (:func:`compile_rank`)."""
    return engine_for(compile_rank(config, executor))
