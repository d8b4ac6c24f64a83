"""Run dcpgraph graphs on a real ``torch.distributed`` world, unchanged.

The graphs call ``torch.ops._c10d_functional.*`` with the logical group names of
:mod:`dcpgraph.collectives.groups`. :func:`register_mesh_groups` makes those names resolve in this
process: ``TP_GROUP`` to the world, ``DCP_GROUP`` to this rank's DCP subgroup. After that,
``gm(*args)`` runs the same GraphModule the emulator runs (:func:`run_distributed_graph`).

:func:`spawn` is the local launcher used by tests and examples: ``world_size`` fresh processes on
127.0.0.1, one thread each, results returned to the caller in rank order.
"""

from __future__ import annotations

import datetime
import pickle
import queue as queue_module
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._C._distributed_c10d import (
    _register_process_group,
    _resolve_process_group,
    _unregister_process_group,
)

from ..collectives.groups import DCP_GROUP, EP_GROUP, PCP_GROUP, TP_GROUP
from ..devices import BACKENDS
from ..mesh import Mesh
from . import host_collectives
from .ports import free_port

__all__ = [
    "RankFailedError",
    "register_mesh_groups",
    "run_distributed_graph",
    "transports",
    "spawn",
    "unregister_mesh_groups",
]

# What register_mesh_groups set up in this process: {"mesh", "world", "groups", "owned"}.
_registered: dict[str, Any] | None = None


def _names_resolve_to(groups: dict[str, dist.ProcessGroup]) -> bool:
    try:
        return (
            _resolve_process_group(TP_GROUP) is groups["tp"]
            and _resolve_process_group(DCP_GROUP) is groups["dcp"]
        )
    except RuntimeError:  # a name is not registered (e.g. the world was destroyed)
        return False


def register_mesh_groups(mesh: Mesh) -> dict[str, dist.ProcessGroup]:
    """Create the DCP subgroups and register the logical group names; return ``{kind: group}``.

    Collective: every process of the initialised world (of size ``mesh.world_size``, ``tp·pcp``)
    must call it, with the same mesh, at the same point. Every process creates every DCP group, in
    the same order (``dist.new_group`` requires it), and keeps only its own. The DCP group is always
    a new communicator, even when it has the same ranks as the world (``dcp == tp``). With
    ``pcp > 1`` the TP name resolves to this rank's PCP replica (its ``tp`` ranks), and the PCP
    name to its PCP group (the ``pcp`` ranks with its TP rank), both new communicators too.

    Idempotent: calling it again with the same mesh on the same world returns the existing groups
    without creating any; a different mesh destroys this module's old subgroups and replaces the
    registrations (the name registry refuses to overwrite, so names are unregistered first).
    """
    global _registered
    if not dist.is_initialized():
        raise RuntimeError("register_mesh_groups needs an initialised torch.distributed world")
    world = dist.group.WORLD
    if dist.get_world_size() != mesh.world_size:
        raise ValueError(
            f"the world has {dist.get_world_size()} processes but {mesh} has {mesh.world_size}"
        )
    state = _registered
    if state is not None and state["world"] is world and _names_resolve_to(state["registered"]):
        if state["mesh"] == mesh:
            return dict(state["groups"])
        unregister_mesh_groups()
    rank = dist.get_rank()
    created = []
    groups = {"tp": world}
    kinds = ("dcp",) if mesh.pcp == 1 else ("dcp", "tp", "pcp")  # pcp > 1: the TP group is a replica's
    for kind in kinds:
        for ranks in sorted({mesh.group(kind, r) for r in mesh.ranks}):
            group = dist.new_group(list(ranks))
            if rank in ranks:
                groups[kind] = group
                created.append(group)
        if kind not in groups:  # cannot happen for a valid Mesh; guards against a changed Mesh
            raise RuntimeError(f"rank {rank} is in no {kind.upper()} group of {mesh}")
    served = {kind: host_collectives.wrap(group) for kind, group in groups.items()}
    registered = {kind: group for kind, (group, _) in served.items()}
    for name, kind in ((TP_GROUP, "tp"), (DCP_GROUP, "dcp"), (PCP_GROUP, "pcp")):
        _unregister_process_group(name)  # a no-op when the name is free
        if kind in registered:
            _register_process_group(name, registered[kind])
    _registered = {"mesh": mesh, "world": world, "groups": groups, "owned": created, "registered": registered,
                   "transport": {kind: note for kind, (_, note) in served.items()}}
    return dict(groups)


def transports() -> dict[str, str]:
    """How this process's registered groups move data: ``{"tp": ..., "dcp": ...}`` ("shared
    memory", or why gloo); empty before :func:`register_mesh_groups`."""
    return dict(_registered["transport"]) if _registered is not None else {}


def unregister_mesh_groups() -> None:
    """Undo :func:`register_mesh_groups` in this process (local; safe to call when not set up)."""
    global _registered
    state, _registered = _registered, None
    for name in (TP_GROUP, DCP_GROUP, PCP_GROUP):
        _unregister_process_group(name)
    for group in (state or {}).get("registered", {}).values():
        host_collectives.release(group)
    if state is None or not dist.is_initialized() or state["world"] is not dist.group.WORLD:
        return  # the world was destroyed, and our subgroups with it
    for group in state["owned"]:
        dist.destroy_process_group(group)


def run_distributed_graph(
    gm: torch.nn.Module, args: Sequence[Any], mesh: Mesh | None = None
) -> Any:
    """``gm(*args)`` on this process, after making sure the logical group names resolve.

    With ``mesh``, registers the groups (collectively, see :func:`register_mesh_groups`);
    without it, the names must already be registered. The graph itself is not modified: this is
    the whole point — the GraphModule the emulator runs is the one that runs here.
    """
    if mesh is not None:
        register_mesh_groups(mesh)
    elif _registered is None or not _names_resolve_to(_registered["registered"]):
        raise RuntimeError(
            f"the group names {TP_GROUP!r}/{DCP_GROUP!r} are not registered in this process: "
            "call register_mesh_groups(mesh) first, or pass mesh="
        )
    return gm(*args)


# -- the EP group of data-parallel replicas ---------------------------------------------------
_expert_group: dict[str, Any] = {}


def join_expert_group(address: tuple[str, int], rank: int, size: int, timeout_s: float) -> dist.ProcessGroup:
    """Join the EP group of ``size`` ranks (every rank of every data-parallel replica; this one is
    EP rank ``rank``) through a TCP store at ``address`` that EP rank 0 hosts, and register it under
    :data:`~dcpgraph.collectives.groups.EP_GROUP`. Each replica keeps its own world (TP and DCP
    groups); this group spans them, so an MoE layer's dispatch and combine reach every replica.
    Collective over the ``size`` ranks: it returns once all have joined (or raises after
    ``timeout_s``)."""
    from torch.distributed import PrefixStore, TCPStore

    host, port = address
    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(host, port, size, is_master=rank == 0, timeout=timeout)
    prefixed = PrefixStore("dcpgraph.ep", store)
    group = dist.ProcessGroup(prefixed, rank, size)
    backend = dist.ProcessGroupGloo(PrefixStore("gloo", prefixed), rank, size, timeout=timeout)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group.barrier().wait()
    _unregister_process_group(EP_GROUP)
    _register_process_group(EP_GROUP, group)
    _expert_group.update(group=group, store=store, rank=rank, size=size)
    return group


def expert_group() -> tuple[dist.ProcessGroup, int, int] | None:
    """``(group, EP rank, EP size)`` after :func:`join_expert_group` in this process, else None."""
    if not _expert_group:
        return None
    return _expert_group["group"], _expert_group["rank"], _expert_group["size"]


def largest_replica_tokens(tokens: int) -> int:
    """The largest of every EP rank's ``tokens`` (the rows each replica pads its MoE tokens to):
    one all-reduce of one integer over the EP group, which every rank of every replica makes
    before each forward."""
    group = _expert_group["group"]
    value = torch.tensor([tokens], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return int(value.item())


# -- local launcher ----------------------------------------------------------------------------
class RankFailedError(RuntimeError):
    """A process started by :func:`spawn` raised or died; the message holds its traceback."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank
        self.detail = detail


def backend_for(device: str | torch.device) -> str:
    """The collective backend for ranks on ``device``: NCCL for CUDA, HCCL for NPU, gloo for the
    host (:data:`dcpgraph.devices.BACKENDS`)."""
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    return BACKENDS.get(kind, "gloo")


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple,
    backend: str,
    port: int,
    timeout_s: float,
    results: Any,
) -> None:
    """One spawned rank. Sends exactly one message, ``(rank, ok, payload)``, as its last act:
    payload is the pickled return value, or the traceback text."""
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())  # one GPU per rank, round robin
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            message = (rank, True, pickle.dumps(fn(rank, world_size, *args)))
        except BaseException:
            message = (rank, False, traceback.format_exc())
        try:
            unregister_mesh_groups()
            dist.destroy_process_group()
        except Exception:
            if message[1]:
                message = (rank, False, "teardown failed:\n" + traceback.format_exc())
    except BaseException:
        message = (rank, False, traceback.format_exc())
    results.put(message)


# Modules the fork server imports once, before it forks any rank: every rank then starts with them
# loaded instead of importing them itself (torch ~3 s; transformers' model base ~5 s on a 2-core
# VM, which every rank that builds or traces an HF model pays). A module that is not installed is
# skipped by the fork server (it ignores ImportError), so transformers stays optional.
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.modeling_utils",
                      "transformers.generation")


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes; return the results.

    The processes never inherit this process's state: ``start_method`` is "forkserver" by default
    where the platform has it, else "spawn" (either way ``fn`` and ``args`` must be picklable and
    ``fn`` a module-level function). The fork server is a fresh single-threaded interpreter that
    imports torch once and forks every later rank from that clean state, so a rank starts in
    milliseconds instead of re-importing torch (seconds each, and it also skips interpreter
    teardown); "spawn" gives the same isolation at that cost. Each rank sets
    ``torch.set_num_threads(1)``, joins a ``torch.distributed`` world on a free port of 127.0.0.1
    and destroys it when ``fn`` returns. Return values travel by ``pickle`` (plain bytes, no shared
    memory), so tensors are copied. ``backend="nccl"`` (see :func:`backend_for`) gives rank ``r``
    CUDA device ``r mod device_count`` before it joins.

    The first rank that raises (or dies) makes this raise :class:`RankFailedError` with its
    traceback; the other processes are killed. Nothing waits longer than ``timeout_s`` overall:
    the collectives' own timeout is set to it too, and on expiry the processes are killed and
    ``TimeoutError`` is raised.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # Only read when the server starts (once per parent process); later calls are no-ops.
        ctx.set_forkserver_preload([*FORKSERVER_PRELOAD, __name__])
    results = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, rank, world_size, args, backend, port, timeout_s, results),
            daemon=True,
            name=f"dcpgraph-rank{rank}",
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout_s
    received: dict[int, Any] = {}
    try:
        for proc in procs:
            proc.start()
        _receive(procs, results, received, deadline, timeout_s)
        for proc in procs:
            proc.join(max(deadline - time.monotonic(), 0.1))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        results.close()
    return [received[rank] for rank in range(world_size)]


def _receive(procs: list, results: Any, received: dict[int, Any], deadline: float, timeout_s: float) -> None:
    """Fill ``received`` (rank -> unpickled result) from every rank by ``deadline``; raises
    :class:`RankFailedError` for the first rank that fails, ``TimeoutError`` past the deadline."""
    world_size = len(procs)
    while len(received) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(received))
            raise TimeoutError(f"spawn: ranks {missing} did not finish within {timeout_s} s")
        try:
            rank, ok, payload = results.get(timeout=min(remaining, 0.2))
        except queue_module.Empty:
            _check_alive(procs, received, results)
            continue
        if not ok:
            raise RankFailedError(rank, payload)
        received[rank] = pickle.loads(payload)


def _check_alive(procs: list, received: dict[int, Any], results: Any) -> None:
    """Raise if a process that has not reported has exited (after one last look at the queue)."""
    for rank, proc in enumerate(procs):
        if rank in received or proc.exitcode is None:
            continue
        try:  # its message may have arrived just after the last get timed out
            got, ok, payload = results.get(timeout=0.5)
        except queue_module.Empty:
            raise RankFailedError(
                rank, f"the process exited with code {proc.exitcode} without reporting"
            ) from None
        if not ok:
            raise RankFailedError(got, payload)
        received[got] = pickle.loads(payload)
        return
