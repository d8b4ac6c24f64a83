"""One scheduler per deployment: rank 0 drives, the other ranks follow.

In a world of one process per rank, rank 0 runs the whole :class:`~.engine.Engine` (scheduler,
block manager, prefix cache, proposer, sampling) on :class:`DriverExecutor` s; every other rank
runs :func:`follow`, which holds only the compiled programs, their caches and their executors.
Rank 0 sends each message to every other rank over a connection of its own
(:class:`ControlGroup`, apart from the groups the graphs' collectives use):

- ``("create", role, num_blocks, fingerprint)``: make the next executor, for the ``target`` or
  the ``draft`` program. Every follower compares the program it compiled with rank 0's
  (:func:`fingerprint`) and answers; one that differs is refused on rank 0, before any rank
  allocates a cache or joins the executor's groups, and the followers go back to waiting.
- ``("run", index, key, shared, per_rank)``: one step of executor ``index`` in graph ``key``.
  Every rank runs its own rank's program on its slice of ``per_rank``; the graphs gather the
  logits, so rank 0's are the step's and the followers answer nothing. A follower whose step
  raises exits (rank 0 then fails in the step's collectives or, first, the process that started
  the workers sees the exit).
- ``("rank_op", name, args)``: a rank op's rank half (:class:`~.engine_client.RankOp`) on every
  rank on the target's caches; the values, or each rank's error, are gathered on rank 0.
- ``("stop",)``: followers return.

A step therefore costs one message of its packed inputs (token ids, positions, slot mappings,
block tables, the bucket) written to each follower, which :attr:`ControlGroup.broadcast_seconds`
totals.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import pickle
import secrets
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch
import torch.distributed as dist

from .. import errors
from ..program import Program
from .engine_client import RankState, run_on_rank
from .executors import DistributedExecutor

_NUMPY_DTYPES = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float64,
                 torch.float32, torch.float16}
_DTYPE_NAMES = {d: str(d).removeprefix("torch.") for d in
                (*_NUMPY_DTYPES, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64)}


def _tensor(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    dtype_ = getattr(torch, dtype)
    if not data:
        return torch.empty(shape, dtype=dtype_)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype_).reshape(shape)


class _StepPickler(pickle.Pickler):
    """Pickles a CPU tensor as its raw bytes, dtype and shape: ~2 µs a small tensor, where torch's
    own reduction (storages, ``_rebuild_tensor_v2``) takes ~150 µs and pickles a view's whole
    storage."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cpu" and not obj.requires_grad and obj.dtype in _NUMPY_DTYPES:
                data = obj.numpy().tobytes()  # C order, whatever the strides
            else:
                data = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            name = _DTYPE_NAMES.get(obj.dtype) or str(obj.dtype).removeprefix("torch.")
            return _tensor, (data, name, tuple(obj.shape))
        return NotImplemented


def pack(message: Any) -> bytes:
    """``message`` as bytes for :func:`pickle.loads` (tensors as raw bytes, see :class:`_StepPickler`)."""
    out = io.BytesIO()
    _StepPickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return out.getvalue()


class ControlGroup:
    """Rank 0's messages to every rank, and their answers back, over one connection from rank 0 to
    each other rank (:mod:`multiprocessing.connection`, authenticated with a key rank 0 draws).

    Collective to create: every rank of the initialised world makes it at the same point, with
    ``host`` an address of rank 0's machine the other ranks reach; rank 0 listens there and
    tells the others where (one ``broadcast_object_list`` over the world, the only gloo call).
    A message is pickled once and written to each connection; a follower waiting for the next one
    blocks in a read (no CPU). A gloo broadcast of the same few KiB costs 1–5 ms on a loaded host
    (its worker threads' wake-ups); a loopback write and read costs tens of microseconds."""

    def __init__(self, host: str = "127.0.0.1"):
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.broadcast_seconds = 0.0  # rank 0's time in broadcast(), in total
        self.followers: list[Connection] = []
        self.driver: Connection | None = None
        key = secrets.token_bytes(32)
        listener = Listener((host, 0), authkey=key) if self.rank == 0 else None
        where = [(listener.address, key) if listener else None]
        dist.broadcast_object_list(where, src=0)
        address, key = where[0]
        if self.rank == 0:
            try:
                accepted = {}
                for _ in range(self.world_size - 1):
                    conn = listener.accept()
                    accepted[conn.recv()] = conn
                self.followers = [accepted[r] for r in range(1, self.world_size)]
            finally:
                listener.close()
        else:
            self.driver = Client(address, authkey=key)
            self.driver.send(self.rank)

    def broadcast(self, message: tuple) -> None:
        """Rank 0: send ``message`` to every other rank."""
        start = time.perf_counter()
        data = pack(message)
        for conn in self.followers:
            conn.send_bytes(data)
        self.broadcast_seconds += time.perf_counter() - start

    def receive(self) -> tuple:
        """A follower: the next message from rank 0 (``EOFError`` once rank 0 is gone)."""
        return pickle.loads(self.driver.recv_bytes())

    def gather(self, value: Any) -> list | None:
        """Every rank's ``value``, in rank order, on rank 0 (None on the others)."""
        if self.rank != 0:
            self.driver.send(value)
            return None
        return [value] + [conn.recv() for conn in self.followers]


def fingerprint(program: Program) -> str:
    """The compiled program's identity across processes: its generated code and the shapes and
    dtypes of its inputs. Ranks compiled from one configuration agree on it."""
    digest = hashlib.sha256(program.graph_module.code.encode())
    for spec in program.inputs:
        digest.update(repr((spec.name, spec.kind)).encode())
    for cache in program.caches:
        digest.update(repr((cache.name, cache.heads, cache.dim, str(cache.dtype))).encode())
    return digest.hexdigest()[:16]


def _error_record(err: BaseException) -> dict:
    return {"type": type(err).__name__, "message": str(err)}


def _raise_record(rank: int, record: dict) -> None:
    cls = getattr(errors, record["type"], None)
    message = f"rank {rank}: {record['message']}"
    if isinstance(cls, type) and issubclass(cls, errors.DcpGraphError):
        raise cls(message)
    raise RuntimeError(f"{record['type']}: {message}")


def _check_answers(answers: list) -> None:
    for rank, answer in enumerate(answers):
        if answer is not None and "error" in answer:
            _raise_record(rank, answer["error"])


class DriverExecutor:
    """Rank 0's executor: each call is broadcast to the followers, then run on rank 0's own
    :class:`~.executors.DistributedExecutor` (whose caches, state and results it exposes)."""

    mode = "driver"

    def __init__(self, control: ControlGroup, role: str, index: int, program: Program, num_blocks, graphs):
        self.control, self.index = control, index
        control.broadcast(("create", role, num_blocks, fingerprint(program)))
        answers = control.gather(None)
        control.broadcast(("go", all(a is None for a in answers)))
        _check_answers(answers)  # raises for the first rank that refused
        self.inner = DistributedExecutor(program, num_blocks, graphs)
        self.program, self.graphs, self.device = program, graphs, self.inner.device

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self.inner.local_ranks

    @property
    def caches(self) -> dict[str, torch.Tensor]:
        return self.inner.caches

    @property
    def last_hidden(self) -> torch.Tensor | None:
        return self.inner.last_hidden

    def rank_caches(self, rank: int) -> dict[str, torch.Tensor]:
        return self.inner.rank_caches(rank)

    def run(self, shared, per_rank, key="mixed") -> torch.Tensor:
        self.control.broadcast(("run", self.index, key, shared, per_rank))
        return self.inner.run(shared, per_rank, key)

    def each_rank(self, name: str, args: dict) -> list:
        """Rank op ``name``'s rank half on every rank; one value per rank, or the first rank's error."""
        self.control.broadcast(("rank_op", name, args))
        try:
            mine: Any = {"value": self.inner.each_rank(name, args)[0]}
        except Exception as err:  # noqa: BLE001 - every rank's outcome is gathered before raising
            mine = {"error": _error_record(err)}
        answers = self.control.gather(mine)
        _check_answers(answers)
        return [a["value"] for a in answers]

    def stop_followers(self) -> None:
        self.control.broadcast(("stop",))


def driver_executors(control: ControlGroup, programs: dict[str, Program]):
    """Rank 0's ``executor_cls``: ``(program, num_blocks, graphs)`` -> the next
    :class:`DriverExecutor`, its role found by identity in ``programs`` (``{"target": ..., "draft": ...}``)."""
    roles = {id(program): role for role, program in programs.items()}
    counter = itertools.count()

    def make(program: Program, num_blocks, graphs) -> DriverExecutor:
        role = roles.get(id(program))
        if role is None:
            raise RuntimeError(f"the engine made an executor for a program that is none of {sorted(programs)}")
        return DriverExecutor(control, role, next(counter), program, num_blocks, graphs)

    return make


def follow(control: ControlGroup, programs: dict[str, tuple[Program, Any]]) -> None:
    """A follower rank: make executors and run steps as rank 0's messages say, until ``stop``.
    ``programs``: ``{role: (program, graphs)}``, compiled the way rank 0 compiled them."""
    executors: list[DistributedExecutor] = []
    target: DistributedExecutor | None = None
    while True:
        message = control.receive()
        op = message[0]
        if op == "run":
            _, index, key, shared, per_rank = message
            executors[index].run(shared, per_rank, key)
        elif op == "create":
            made = _create(control, programs, *message[1:])
            if made is not None:
                executors.append(made)
                target = made if message[1] == "target" else target
        elif op == "rank_op":
            control.gather(_rank_half(target, *message[1:]))
        elif op == "stop":
            return
        else:
            raise RuntimeError(f"unknown message {op!r} from rank 0")


def _create(control: ControlGroup, programs, role: str, num_blocks, expected: str) -> DistributedExecutor | None:
    """A follower's part in making an executor: compare programs, answer, build if rank 0 says go."""
    answer = None
    if role not in programs:
        answer = {"error": {"type": "ConfigError", "message": f"no {role} program here (have {sorted(programs)})"}}
    elif fingerprint(programs[role][0]) != expected:
        answer = {"error": {"type": "ConfigError", "message": f"compiled a different {role} program than rank 0 "
                            "(different checkpoint files or options reached this rank)"}}
    control.gather(answer)
    _, go = control.receive()
    if not go:
        return None
    program, graphs = programs[role]
    return DistributedExecutor(program, num_blocks, graphs)


def _rank_half(target: DistributedExecutor | None, name: str, args: dict) -> dict:
    if target is None:
        return {"error": {"type": "RuntimeError", "message": "no target executor on this rank yet"}}
    try:
        return {"value": run_on_rank(name, RankState(target.rank, target.program, target.caches), args)}
    except Exception as err:  # noqa: BLE001 - sent to rank 0, which raises it
        return {"error": _error_record(err)}
