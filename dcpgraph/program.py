"""``Program``: an FX graph plus everything needed to run it, JAX-style (no hidden state).

Every placeholder of ``Program.graph_module`` is described by one :class:`InputSpec`, in order:
parameters, buffers and constants (values kept by reference in ``Program.state``, never mutated),
the model's user inputs (``input_ids``, ``position_ids``), and after later passes the KV caches,
the per-step metadata and the per-rank values (``tp_rank``/``dcp_rank``). A Program is immutable:
passes build a new one with :meth:`Program.replace`, and :meth:`Program.copy_graph` gives them a
private graph to edit.

:func:`example_specs` gives the (shape, dtype) of an example value for every input, from which the
verifier's shape propagation fills ``meta["val"]``: ``EXAMPLE_TOKENS`` tokens in
``EXAMPLE_REQUESTS`` requests, caches of ``EXAMPLE_BLOCKS`` blocks, state sharded as rank 0 holds it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from .errors import VerificationError
from .mesh import Mesh
from .shard_rules import (  # noqa: F401  (re-exported: the rules live in shard_rules, programs name them)
    REPLICATE,
    ReplicaExpertShard,
    RowSections,
    ShardRule,
    section_ranges,
    zero_padded,
)

# Kinds of program inputs.
PARAM, BUFFER, CONSTANT, USER, CACHE, META, RANK = (
    "param", "buffer", "constant", "user", "cache", "meta", "rank",
)
RECURRENT = "recurrent"  # a recurrent layer's per-request state pool, indexed by state slot
STATE_KINDS = (PARAM, BUFFER, CONSTANT)


@dataclass(frozen=True)
class Lowering:
    """What the passes decided about a program, for later passes and the runtime to read: each
    field is written by the pass named beside it and unset (None, or empty) before that pass."""

    block_size: int | None = None  # insert_kv_cache: tokens per KV block on each rank
    kv_cache_dtype: str | None = None  # insert_kv_cache: "auto" | "bf16" | "fp8_e4m3"
    interleave: int = 1  # compile_program: DCP interleave, I (tokens per rank per round)
    comm: str | None = None  # shard_dcp: the DCP lowering ("a2a" | "ag_rs" | "ag"; "none" at dcp=1)
    comm_choice: str | None = None  # shard_dcp with comm="auto": the prices it chose by
    new_tokens: str | None = None  # fuse_new_tokens: "fused" (one paged read) | "split"
    hidden_states_output: int | None = None  # return_hidden_states: the output holding them
    sliding_caches: tuple[str, ...] = ()  # layer_group_tables: caches of the sliding-window group
    sliding_window: int | None = None  # layer_group_tables: the largest window
    state_slots: int | None = None  # Engine: recurrent-state slots per pool (one per running request)
    expert_ranks: int | None = None  # experts_over_replicas: ranks of the EP group (replicas · tp)
    replica: int | None = None  # experts_over_replicas: which data-parallel replica this program is
    state_snapshots: int | None = None  # compile/Engine with speculation: pool rows after the slots (runtime.state_rollback)
    state_prefix_rows: int | None = None  # compile/Engine with prefix caching: rows after those (runtime.state_prefix_cache)

    def decided(self, **fields: Any) -> Lowering:
        """This record with ``fields`` set (what one pass decides)."""
        return dataclasses.replace(self, **fields)

    def items(self) -> list[tuple[str, Any]]:
        """``(field, value)`` of every field that is set, by name."""
        unset = (None, ())
        return sorted((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                      if getattr(self, f.name) not in unset)


@dataclass(frozen=True)
class StateSource:
    """A state entry a pass derived from other entries: ``op`` applied to the full tensors of
    ``inputs`` (state keys), with ``args``. Entries without one are the model's own tensors.

    Ops: ``"mla_absorbed_uk"`` / ``"mla_absorbed_uv_t"`` with ``args = (nope, v_head_dim,
    kv_lora_rank)``: :func:`dcpgraph.passes.absorb_mla.absorbed` of the up-projection weight;
    ``"concat_rows"``: ``torch.cat`` of the inputs along dim 0 (sibling linears' weights or biases
    fused by :mod:`dcpgraph.passes.fuse_linears`).
    """

    op: str
    inputs: tuple[str, ...]
    args: tuple = ()


@dataclass(frozen=True)
class InputSpec:
    """One placeholder. ``target`` is the state key (FQN) for state kinds, else a role name."""

    name: str
    kind: str
    target: str
    shard: ShardRule = REPLICATE


@dataclass(frozen=True)
class CacheSpec:
    """One paged KV cache tensor per rank: ``[num_blocks, rows_per_block(block_size), heads, dim]``.
    A row holds one token, or with ``tokens_per_row = m`` one entry summarising ``m`` consecutive
    positions (DeepSeek-V4's compressed entries): ``ceil(block_size / m)`` rows per block."""

    name: str  # placeholder name
    layer: int
    role: str  # "k", "v" or "latent"
    heads: int  # per rank
    dim: int
    dtype: torch.dtype
    tokens_per_row: int = 1

    def rows_per_block(self, block_size: int) -> int:
        return -(-int(block_size) // self.tokens_per_row)


@dataclass(frozen=True)
class RecurrentStateSpec:
    """One recurrent layer's state pool per rank: ``[slots, *shape]``, one slot per request
    (see :mod:`dcpgraph.recurrent_state` for the layouts and their byte formulas)."""

    name: str  # placeholder name
    layer: int  # decoder layer index
    role: str  # "conv_state" or "recurrent_state"
    shape: tuple[int, ...]  # per slot
    dtype: torch.dtype

    @property
    def bytes_per_slot(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class ModelFacts:
    """What the compiler knows about the model, read from its config and graph."""

    architecture: str
    attention: str  # "gqa" or "mla"
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int  # query/key head dim of the canonical attention
    v_head_dim: int
    vocab_size: int
    hidden_size: int
    dtype: torch.dtype = torch.float32
    eos_token_id: tuple[int, ...] = ()
    tp_plan: Mapping[str, str] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)
    # Per attention layer (graph order), only where the model's layers differ (else empty):
    # KV heads and query/key head dims. ``num_kv_heads``/``head_dim`` then hold layer 0's.
    layer_kv_heads: tuple[int, ...] = ()
    layer_head_dims: tuple[int, ...] = ()


@dataclass(frozen=True)
class Provenance:
    """What a pass did: its name, wall time, and a summary of what it matched or changed."""

    name: str
    seconds: float
    summary: str

    def __str__(self) -> str:
        return f"# {self.name} ({self.seconds * 1e3:.1f} ms): {self.summary}"


@dataclass(frozen=True)
class Program:
    graph_module: torch.fx.GraphModule
    inputs: tuple[InputSpec, ...]
    facts: ModelFacts
    state: Mapping[str, torch.Tensor]
    mesh: Mesh = Mesh(1, 1)
    caches: tuple[CacheSpec, ...] = ()
    recurrent_states: tuple[RecurrentStateSpec, ...] = ()
    lowering: Lowering = field(default_factory=lambda: Lowering())
    provenance: tuple[Provenance, ...] = ()
    # (pass name, the Program right after that pass): graph *and* its input specs, caches, mesh…
    # Snapshots keep ``stages=()`` themselves, so the history is flat.
    stages: tuple[tuple[str, Program], ...] = ()
    # How passes derived state entries from others (see StateSource), by state key.
    sources: Mapping[str, StateSource] = field(default_factory=dict)
    # When set, ``local_state`` reads rank ``r``'s tensors with ``state_reader(self, r)`` instead
    # of slicing ``state`` (which may then hold meta tensors: shapes and dtypes only).
    state_reader: Callable[[Program, int], list[torch.Tensor]] | None = None
    # When set (a device kind: "cpu", "cuda", "npu"), ``local_state`` moves each rank's tensors
    # there (for an accelerator: the process's current device of that kind); None: where they are.
    device: str | None = None

    # -- construction helpers for passes -------------------------------------------------------
    def replace(self, **changes: Any) -> Program:
        return dataclasses.replace(self, **changes)

    def copy_graph(self) -> torch.fx.GraphModule:
        """A new GraphModule over a deep copy of the graph (node meta copied, values shared)."""
        graph = torch.fx.Graph()
        value_map: dict[torch.fx.Node, torch.fx.Node] = {}
        out = graph.graph_copy(self.graph_module.graph, value_map)
        graph.output(out)
        for old, new in value_map.items():
            new.meta = copy.copy(old.meta)
        gm = torch.fx.GraphModule(self.graph_module, graph)
        return gm

    def placeholders(self) -> list[torch.fx.Node]:
        return [n for n in self.graph_module.graph.nodes if n.op == "placeholder"]

    def spec(self, name: str) -> InputSpec:
        for s in self.inputs:
            if s.name == name:
                return s
        raise KeyError(name)

    def inputs_of(self, kind: str) -> list[InputSpec]:
        return [s for s in self.inputs if s.kind == kind]

    def local_state(self, rank: int) -> list[torch.Tensor]:
        """This rank's parameters/buffers/constants, in placeholder order."""
        if self.state_reader is not None:
            tensors = self.state_reader(self, rank)
        else:
            tp, tp_rank = self.mesh.tp, self.mesh.tp_rank(rank)  # every PCP replica holds its TP rank's shard
            tensors = [s.shard.local(self.state[s.target], tp_rank, tp) for s in self.inputs if s.kind in STATE_KINDS]
        if self.device is None:
            return tensors
        return [t.to(self.device) if isinstance(t, torch.Tensor) else t for t in tensors]

    def with_stage(self, name: str, gm: torch.fx.GraphModule, record: Provenance) -> Program:
        snapshot = self.replace(graph_module=gm, provenance=(*self.provenance, record), stages=())
        return snapshot.replace(stages=(*self.stages, (name, snapshot)))

    def passes_run(self) -> list[str]:
        """Names of the passes that made this Program, in order (``trace`` first for a traced
        model), from its provenance, which stage snapshots keep too."""
        return [record.name for record in self.provenance]

    def stage(self, name: str) -> Program:
        """The Program as it was right after pass ``name`` (the last such stage)."""
        for stage_name, snapshot in reversed(self.stages):
            if stage_name == name:
                return snapshot
        raise KeyError(f"no stage {name!r}; stages: {[n for n, _ in self.stages]}")


# -- example inputs ------------------------------------------------------------------------------
EXAMPLE_TOKENS = 6
EXAMPLE_REQUESTS = 2
EXAMPLE_BLOCKS = 8
EXAMPLE_TABLE_WIDTH = 4
EXAMPLE_STATE_SLOTS = EXAMPLE_REQUESTS + 1

def role_shapes(tokens: int, requests: int, table_width: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of user/meta/rank inputs, by role (``InputSpec.target``), for a step of
    ``tokens`` tokens in ``requests`` requests with block tables ``table_width`` wide."""
    t, r, w = tokens, requests, table_width
    return {
        "input_ids": ((1, t), torch.int64),
        "position_ids": ((1, t), torch.int64),
        "cu_seqlens_q": ((r + 1,), torch.int32),
        "context_lens": ((r,), torch.int32),
        "local_context_lens": ((r,), torch.int32),
        "block_table": ((r, w), torch.int32),
        "slot_mapping": ((t,), torch.int64),
        "block_table_sliding": ((r, w), torch.int32),  # hybrid_kv_cache
        "slot_mapping_sliding": ((t,), torch.int64),
        "logits_indices": ((r,), torch.int64),
        "state_slots": ((r,), torch.int64),  # recurrent layers' per-request slot (−1: padding)
        "tp_rank": ((), torch.int64),
        "dcp_rank": ((), torch.int64),
        "ep_rank": ((), torch.int64),  # data-parallel replicas with EP: replica·tp + tp_rank
        "ep_rows": ((t,), torch.int64),  # its length: the rows every replica pads its tokens to
        "pcp_rows": ((t,), torch.int64),  # pcp > 1: the step's token rows this rank computes (padded)
        "pcp_order": ((t,), torch.int64),  # pcp > 1: each token's row in the PCP all-gather
        "pcp_cu_seqlens_q": ((r + 1,), torch.int32),  # pcp > 1, dcp = 1: request boundaries of pcp_rows
        "pcp_group_rows": ((t,), torch.int64),  # 1 < dcp < pcp: the rows this rank's DCP group attends
        "pcp_group_cu_seqlens_q": ((r + 1,), torch.int32),  # their request boundaries
        "pcp_own_in_group": ((t,), torch.int64),  # where each of pcp_rows sits among pcp_group_rows
    }


def example_specs(program: Program, *, tokens: int = EXAMPLE_TOKENS, requests: int = EXAMPLE_REQUESTS,
                  table_width: int = EXAMPLE_TABLE_WIDTH) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of an example input for every entry of ``program.inputs``, in order.

    State: the full tensor's shape under its shard rule for rank 0 of ``program.mesh.tp``;
    caches: ``[EXAMPLE_BLOCKS, block_size, heads, dim]``; recurrent state pools
    ``[EXAMPLE_STATE_SLOTS, *shape]``; user/meta/rank inputs: by role, for a
    step of ``tokens`` tokens in ``requests`` requests (default: the verifier's example step).
    """
    caches = {c.name: c for c in program.caches}
    pools = {p.name: p for p in program.recurrent_states}
    block_size = int(program.lowering.block_size or 16)
    roles = role_shapes(tokens, requests, table_width)
    out = []
    for spec in program.inputs:
        if spec.kind in STATE_KINDS:
            full = program.state[spec.target]
            shape = spec.shard.local_shape(tuple(full.shape), program.mesh.tp)
            out.append((shape, full.dtype))
        elif spec.kind == CACHE:
            c = caches[spec.name]
            out.append(((EXAMPLE_BLOCKS, c.rows_per_block(block_size), c.heads, c.dim), c.dtype))
        elif spec.kind == RECURRENT:
            pool = pools[spec.name]
            out.append(((EXAMPLE_STATE_SLOTS, *pool.shape), pool.dtype))
        elif spec.kind == USER and spec.target == "hidden_states":  # an MTP layer's [1, T, H] input
            width = program.facts.extra.get("hidden_states_width") or program.facts.hidden_size  # V4: n·H
            out.append(((1, tokens, width), program.facts.dtype))
        elif spec.kind in (USER, META, RANK):
            if spec.target not in roles:
                raise VerificationError(
                    f"input {spec.name!r} has unknown role {spec.target!r}; known roles: {sorted(roles)}"
                )
            out.append(roles[spec.target])
        else:
            raise VerificationError(f"input {spec.name!r} has unknown kind {spec.kind!r}")
    return out


def weight_bytes_per_rank(program) -> list[int]:
    """Bytes of parameters, buffers and constants each TP rank holds (its shards), rank order."""
    tp = program.mesh.tp
    per_rank = [0] * tp
    for spec in program.inputs:
        if spec.kind not in STATE_KINDS:
            continue
        full = program.state[spec.target]
        for rank in range(tp):
            shape = spec.shard.local_shape(tuple(full.shape), tp)
            numel = 1
            for size in shape:
                numel *= size
            per_rank[rank] += numel * full.element_size()
    return per_rank
