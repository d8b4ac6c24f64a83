"""Executors: run one step of a compiled program on every rank.

- :class:`EmulatedExecutor`: all ranks in this process, in lockstep, through
  :func:`~dcpgraph.runtime.emulator.run_spmd` (a single rank runs the graph directly).
- :class:`DistributedExecutor`: this process is one rank of an initialised ``torch.distributed``
  world of size ``tp`` (e.g. under ``torchrun``); it runs only its own rank, and every rank,
  running the same deterministic engine, reaches the same result.

Both own the per-rank KV caches (allocated once, written in place by the program) and the
per-rank parameter shards (computed once from the full parameters). The device is the parameters'
(:func:`state_device`): caches are allocated there and each step's inputs, built on the host by
:mod:`.step_inputs`, are copied there; logits come back to the host, where sampling runs with each
request's own CPU generator. ``local_ranks`` names the ranks
whose caches this process holds and ``rank_caches(rank)`` returns one of them (cache name ->
``[num_blocks, block_size, heads, dim]``), so code that reads caches asks the executor what it has.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import ConfigError
from ..program import CACHE, META, RANK, RECURRENT, STATE_KINDS, USER, Program
from . import host_memory
from .engine_client import RankState, run_on_rank
from .state_rollback import STATE_COPIES, apply_state_copies, pool_rows


def state_device(state: list[torch.Tensor]) -> torch.device:
    """Where a rank runs: its parameters' device (the host for a program without any)."""
    devices = {t.device for t in state if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        raise ValueError(f"a rank's parameters span devices {sorted(map(str, devices))}: move the model to one device")
    return devices.pop() if devices else torch.device("cpu")


def allocate_caches(program: Program, num_blocks: int | Mapping[str, int],
                    device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Zeroed caches ``[blocks, block_size, heads, dim]`` on ``device`` (on the host: on huge pages
    where :func:`host_memory.status` allows, so a block-table read is rarely a TLB miss). ``num_blocks``: one count
    for every cache, or per layer group ``{"full": n, "sliding": m}`` (``hybrid_kv_cache``: the
    caches named in ``Lowering.sliding_caches`` get ``m``)."""
    block = int(program.lowering.block_size)
    sliding = set(program.lowering.sliding_caches)
    counts = num_blocks if isinstance(num_blocks, Mapping) else {"full": num_blocks, "sliding": num_blocks}
    caches = {c.name: host_memory.zeros((counts["sliding" if c.name in sliding else "full"], c.rows_per_block(block),
                                         c.heads, c.dim),
                                        c.dtype, device)
              for c in program.caches}
    if program.recurrent_states:
        if not program.lowering.state_slots:
            raise ValueError("a program with recurrent state pools needs Lowering.state_slots (set by the Engine)")
        rows = pool_rows(program)  # the slots, then their snapshots under speculation (state_rollback)
        caches.update({p.name: host_memory.zeros((rows, *p.shape), p.dtype, device)  # lazily mapped: slots unused
                       for p in program.recurrent_states})
    return caches


def on_device(inputs: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    if device.type == "cpu":
        return inputs
    return {k: v.to(device, non_blocking=True) for k, v in inputs.items()}


def rank_arguments(
    program: Program,
    state: list[torch.Tensor],
    caches: dict[str, torch.Tensor],
    shared: dict[str, torch.Tensor],
    own: dict[str, torch.Tensor],
) -> list[torch.Tensor]:
    args, states = [], iter(state)
    for spec in program.inputs:
        if spec.kind in STATE_KINDS:
            args.append(next(states))
        elif spec.kind in (CACHE, RECURRENT):
            args.append(caches[spec.name])
        elif spec.kind in (USER, META):
            args.append(shared[spec.target] if spec.target in shared else own[spec.target])
        elif spec.kind == RANK:
            args.append(own[spec.target])
        else:
            raise ValueError(f"unknown input kind {spec.kind}")
    return args


def expert_inputs(shared: dict[str, torch.Tensor], own: dict[str, torch.Tensor]):
    """A step's inputs plus what experts shared by data-parallel replicas read: ``ep_rank`` (this
    rank's index in the EP group) and ``ep_rows``, whose length is the largest token count of any
    replica this step (one all-reduce over the EP group; :mod:`dcpgraph.passes.experts_over_replicas`)."""
    from .distributed import expert_group, largest_replica_tokens

    joined = expert_group()
    if joined is None:
        raise RuntimeError("this program partitions its experts over data-parallel replicas, but this process has "
                           "not joined their EP group (dcpgraph.runtime.distributed.join_expert_group)")
    rows = largest_replica_tokens(int(shared["input_ids"].shape[-1]))
    return ({**shared, "ep_rows": torch.zeros(rows, dtype=torch.int64)},
            {**own, "ep_rank": torch.tensor(joined[1], dtype=torch.int64)})


def logits_of(output) -> torch.Tensor:
    first = output[0] if isinstance(output, (tuple, list)) else output
    return first[0].cpu()  # [1, R, V] -> [R, V], on the host (a no-op there)


def hidden_of(program: Program, output) -> torch.Tensor | None:
    """The final hidden states ``[T, H]`` of a program compiled with ``return_hidden``
    (output ``Lowering.hidden_states_output``), else ``None``."""
    index = program.lowering.hidden_states_output
    return None if index is None else output[index][0]


class EmulatedExecutor:
    mode = "emulated"

    def __init__(self, program: Program, num_blocks: int, graphs=None):
        if program.lowering.expert_ranks is not None:
            raise ConfigError(
                f"this program's routed experts are partitioned over {program.lowering.expert_ranks} ranks of "
                "data-parallel replicas: it runs on the distributed executor, one worker process per rank "
                "(LLM or dcpgraph serve with data_parallel_size and enable_expert_parallel), not emulated")
        self.program = program
        self.ranks = list(program.mesh.ranks)
        self.states = [program.local_state(r) for r in self.ranks]
        self.device = state_device(self.states[0])
        self.caches = [allocate_caches(program, num_blocks, self.device) for _ in self.ranks]
        self.graphs = graphs
        self.last_hidden: torch.Tensor | None = None  # the last run's hidden states (return_hidden)

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return tuple(self.ranks)

    def rank_caches(self, rank: int) -> dict[str, torch.Tensor]:
        return self.caches[rank]

    def each_rank(self, name: str, args: dict) -> list:
        """Rank op ``name``'s rank half on every rank, in rank order."""
        return [run_on_rank(name, RankState(r, self.program, self.caches[r]), args) for r in self.ranks]

    def run(self, shared, per_rank, key="mixed") -> torch.Tensor:
        from .emulator import run_spmd

        for r in self.ranks:  # the step's state copies first (state_rollback); the graph ignores them
            apply_state_copies(self.program, self.caches[r], shared.get(STATE_COPIES))
        shared = on_device(shared, self.device)
        args = [rank_arguments(self.program, self.states[r], self.caches[r], shared, on_device(per_rank[r], self.device))
                for r in self.ranks]
        if len(self.ranks) == 1:
            fn = (self.graphs.get(key) if self.graphs is not None else None) or self.program.graph_module
            output = fn(*args[0])
        else:
            output = run_spmd(self.program.graph_module, args, self.program.mesh)[0]
        self.last_hidden = hidden_of(self.program, output)  # the same on every rank
        return logits_of(output)


class DistributedExecutor:
    mode = "distributed"

    def __init__(self, program: Program, num_blocks: int, graphs=None):
        import torch.distributed as dist

        from .distributed import register_mesh_groups

        self.program = program
        self.rank = dist.get_rank()
        register_mesh_groups(program.mesh)
        self.state = program.local_state(self.rank)
        self.device = state_device(self.state)
        self.caches = allocate_caches(program, num_blocks, self.device)
        self.graphs = graphs
        self.last_hidden: torch.Tensor | None = None

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return (self.rank,)

    def rank_caches(self, rank: int) -> dict[str, torch.Tensor]:
        if rank != self.rank:
            raise ValueError(f"rank {rank}'s caches live in another process (this is rank {self.rank})")
        return self.caches

    def each_rank(self, name: str, args: dict) -> list:
        """Rank op ``name``'s rank half on this process's rank (every rank of the world runs it)."""
        return [run_on_rank(name, RankState(self.rank, self.program, self.caches), args)]

    def run(self, shared, per_rank, key="mixed") -> torch.Tensor:
        apply_state_copies(self.program, self.caches, shared.get(STATE_COPIES))  # before the graph (state_rollback)
        own = per_rank[self.rank]
        if self.program.lowering.expert_ranks is not None:
            shared, own = expert_inputs(shared, own)
        args = rank_arguments(self.program, self.state, self.caches, on_device(shared, self.device),
                              on_device(own, self.device))
        fn = (self.graphs.get(key) if self.graphs is not None else None) or self.program.graph_module
        output = fn(*args)
        self.last_hidden = hidden_of(self.program, output)
        return logits_of(output)
