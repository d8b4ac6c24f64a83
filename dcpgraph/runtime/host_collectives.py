"""Collectives between ranks on one host through shared memory: a ``torch.distributed`` group.

Gloo moves a few KiB between two processes of one host in ~0.5–1.5 ms (its worker threads and
their wake-ups; a TCP round trip on the same loopback is ~15 µs), and a tp=2 decode step runs two
to three collectives a layer. :class:`SharedMemoryGroup` serves the graph's functional collectives
for ranks that share a host: it is registered under the logical group names in place of the gloo
group it wraps (:func:`dcpgraph.runtime.distributed.register_mesh_groups`), and hands anything it
does not serve to that gloo group.

One segment per group, mapped by every member: a header (member ``i``'s arrival count on its own
cache line at ``64·i``, its pid at ``64·(n + i)``), then two buffers of ``n`` slots. Collective
number ``s`` (the members' calls are numbered alike; the graph issues them in one order on every
rank) uses buffer ``s mod 2``::

    publish:  copy the payload into my slot of buffer s mod 2; full fence; arrival[me] = s
    wait:     until arrival[j] >= s for every member j (spin, then yield; deadline and peers' pids checked)
    result:   computed from every member's slot, in group-rank order (sums are ((x0 + x1) + x2)…,
              so every member gets the same bits, as the emulator's semantics say)

A member writes buffer ``s mod 2`` only after it saw every member arrive at ``s − 1``, that is
after each of them finished reading collective ``s − 2``, the last one that used that buffer: no
second wait per collective. A member that dies while others wait for it is seen by its pid within
:data:`LIVENESS_S` and raises in every waiting member (gloo sees the closed connection); one that
never arrives raises at the group's timeout. Served: ``all_reduce`` and ``reduce_scatter_tensor``
(sum, avg of floating tensors, product, min, max, band, bor, bxor), ``all_gather_into_tensor`` and
``all_to_all_single`` with equal splits, of CPU tensors. A payload larger than a slot goes as
consecutive slot-sized pieces of its flat elements, one exchange each, every member taking from
each piece what its result needs before publishing the next (so a piece's views are never
overwritten while read). The choice (served or not, and the pieces) depends only on what every
member's call has alike (sizes, dtype, op), so all members choose the same way. ``DCPGRAPH_HOST_COLLECTIVES=gloo`` turns it off; it is also off where the members are on
different hosts or the small C++ helper (``ops/csrc/host_sync.cpp``) cannot be built.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import tempfile
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from ..collectives.registry import reduce_in_rank_order
from ..ops.native_build import NativeExtension

_SRC = Path(__file__).resolve().parent.parent / "ops" / "csrc" / "host_sync.cpp"
EXTENSION = NativeExtension("dcpgraph_host_sync", _SRC, "shared-memory collectives", "collectives go through gloo")
ENV = "DCPGRAPH_HOST_COLLECTIVES"  # "shm" (default) or "gloo"
SLOT_ENV = "DCPGRAPH_HOST_COLLECTIVE_SLOT_MIB"
SLOT_MIB = 4  # largest payload a member publishes per exchange (a 256-token prefill chunk's fp32
# all-reduce at hidden 4096); larger ones go in pieces of this size. A group reserves 2 · members · slot bytes.
LINE = 64
FLAG_STRIDE = LINE // 8  # int64s between two members' arrival counts
SPINS = 4096  # pause rounds per wait_all call before yielding
LIVENESS_S = 0.05  # how often a waiting member checks its peers' pids and its deadline
_REDUCE = {dist.ReduceOp.RedOpType.SUM: "sum", dist.ReduceOp.RedOpType.AVG: "avg",
           dist.ReduceOp.RedOpType.PRODUCT: "product", dist.ReduceOp.RedOpType.MIN: "min",
           dist.ReduceOp.RedOpType.MAX: "max", dist.ReduceOp.RedOpType.BAND: "band",
           dist.ReduceOp.RedOpType.BOR: "bor", dist.ReduceOp.RedOpType.BXOR: "bxor"}


def _reduce_op(opts) -> str | None:
    """The served name of a call's reduce op (keyed by its type: ReduceOp objects do not hash alike)."""
    if opts is None:
        return "sum"
    op = opts.reduceOp
    return _REDUCE.get(getattr(op, "op", op))


class PeerLostError(RuntimeError):
    """A member of a shared-memory group died or missed its deadline while others waited for it."""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: not gone, and not a zombie its parent has yet to reap."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: the signal probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


class Segment:
    """The mapped header and buffers of one group (see the module docstring for the layout)."""

    def __init__(self, path: str, members: int, slot_bytes: int, create: bool) -> None:
        self.members, self.slot_bytes = members, slot_bytes
        self.header_bytes = -(-2 * members * LINE // 4096) * 4096
        size = self.header_bytes + 2 * members * slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:  # reserved now: a full /dev/shm is a clear fallback here, not a SIGBUS mid-step
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self.base = self.bytes.data_ptr()
        self.header = self.bytes[:self.header_bytes].view(torch.int64)
        self.buffers = self.bytes[self.header_bytes:].view(2, members, slot_bytes)

    def flag_address(self, member: int) -> int:
        return self.base + member * LINE

    def pid(self, member: int) -> int:
        return int(self.header[(self.members + member) * FLAG_STRIDE])

    def close(self) -> None:
        del self.bytes, self.header, self.buffers
        self.map.close()


class SharedMemoryGroup(dist.ProcessGroup):
    """The functional collectives of ``fallback``'s members through a :class:`Segment`; anything
    else goes to ``fallback`` (a gloo group of the same members, in the same rank order)."""

    def __init__(self, fallback: dist.ProcessGroup, segment: Segment, timeout_s: float, sync) -> None:
        super().__init__(fallback.rank(), fallback.size())
        self.fallback, self.segment, self.timeout_s, self.sync = fallback, segment, timeout_s, sync
        self.me, self.n = fallback.rank(), fallback.size()
        self.seq = 0
        self.served = 0  # collectives served here (the rest went to the fallback)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "dcpgraph-shm"

    # -- the exchange ------------------------------------------------------------------------------
    @staticmethod
    def _local(*tensors: torch.Tensor) -> bool:
        return all(t.device.type == "cpu" and not t.is_sparse for t in tensors)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every member's flat contiguous ``x`` (at most a slot; same size and dtype on all), as
        views of the shared buffer: valid until this member's next exchange."""
        nbytes = x.numel() * x.element_size()
        self.seq += 1
        slots = self.segment.buffers[self.seq & 1]
        self.sync.publish(slots[self.me].data_ptr(), x.data_ptr(), nbytes, self.segment.flag_address(self.me), self.seq)
        self._wait(self.seq)
        return [slots[j, :nbytes].view(x.dtype) for j in range(self.n)]

    def _pieces(self, flat: torch.Tensor):
        """``(start, stop, parts)`` for consecutive ranges of the flat contiguous ``flat`` of at
        most a slot each (one empty range for an empty tensor): ``parts[j]`` is member ``j``'s
        ``flat[start:stop]``, valid until the next piece is asked for."""
        per = max(1, self.segment.slot_bytes // flat.element_size())
        start = 0
        while True:
            stop = min(flat.numel(), start + per)
            yield start, stop, self._exchange(flat[start:stop])
            start = stop
            if start >= flat.numel():
                return

    @staticmethod
    def _flat_out(out: torch.Tensor) -> torch.Tensor:
        """``out``'s elements as a flat tensor to write (``out`` itself where contiguous)."""
        return out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype)

    @staticmethod
    def _finish(out: torch.Tensor, flat: torch.Tensor) -> None:
        if flat.data_ptr() != out.data_ptr() or not out.is_contiguous():
            out.copy_(flat.view(out.shape))

    def _mine(self, flat_in: torch.Tensor, flat_out: torch.Tensor, combine) -> None:
        """For chunk ``me`` of ``n`` equal flat chunks of every member's input: ``combine(lo, hi,
        parts)`` with each member's elements ``[lo, hi)`` of that chunk (offsets within it), piece
        by piece."""
        chunk = flat_in.numel() // self.n
        first, last = self.me * chunk, (self.me + 1) * chunk
        for a, b, parts in self._pieces(flat_in):
            lo, hi = max(a, first), min(b, last)
            if lo < hi:
                combine(lo - first, hi - first, [p[lo - a:hi - a] for p in parts])

    def _wait(self, seq: int) -> None:
        flags = self.segment.base
        if self.sync.wait_all(flags, FLAG_STRIDE, self.n, seq, SPINS):
            return
        start = time.monotonic()
        check = start + LIVENESS_S
        while not self.sync.wait_all(flags, FLAG_STRIDE, self.n, seq, SPINS):
            os.sched_yield()
            now = time.monotonic()
            if now < check:
                continue
            check = now + LIVENESS_S
            late = [j for j in range(self.n) if int(self.segment.header[j * FLAG_STRIDE]) < seq]
            for j in late:
                pid = self.segment.pid(j)
                if not _alive(pid):
                    raise PeerLostError(f"group rank {j} (pid {pid}) exited while group rank {self.me} waited "
                                        f"for it in shared-memory collective #{seq}")
            if now - start > self.timeout_s:
                raise PeerLostError(f"group ranks {late} did not reach shared-memory collective #{seq} within "
                                    f"{self.timeout_s:.0f} s (group rank {self.me} waited)")

    @staticmethod
    def _serves(op: str | None, x: torch.Tensor) -> bool:
        """A reduce op served here: avg only of floating tensors (as the emulator defines it)."""
        return op is not None and (op != "avg" or x.is_floating_point())

    @staticmethod
    def _done(result):
        future = torch.futures.Future()
        future.set_result(result)
        return torch._C._distributed_c10d._create_work_from_future(future)

    # -- the ProcessGroup methods functional collectives call ----------------------------------------
    def allreduce(self, tensors, opts=None):
        op = _reduce_op(opts)
        if len(tensors) != 1 or not self._serves(op, tensors[0]) or not self._local(tensors[0]):
            return self.fallback.allreduce(tensors, opts)
        out = tensors[0]
        flat = out.contiguous().view(-1)  # read piece by piece, each range written after its exchange
        for a, b, parts in self._pieces(flat):
            flat[a:b] = reduce_in_rank_order(parts, op)
        self._finish(out, flat)
        self.served += 1
        return self._done(tensors)

    def _allgather_base(self, output, input, opts=None):  # noqa: A002 - torch's name
        if not self._local(input, output) or output.numel() != input.numel() * self.n:
            return self.fallback._allgather_base(output, input, opts)
        flat_in, flat_out, size = input.contiguous().view(-1), self._flat_out(output), input.numel()
        for a, b, parts in self._pieces(flat_in):
            for j, p in enumerate(parts):
                flat_out[j * size + a:j * size + b] = p
        self._finish(output, flat_out)
        self.served += 1
        return self._done([output])

    def _reduce_scatter_base(self, output, input, opts=None):  # noqa: A002
        op = _reduce_op(opts)
        if not self._serves(op, input) or not self._local(input, output) or input.numel() != output.numel() * self.n:
            return self.fallback._reduce_scatter_base(output, input, opts)
        flat_out = self._flat_out(output)

        def reduce(lo, hi, parts):
            flat_out[lo:hi] = reduce_in_rank_order(parts, op)

        self._mine(input.contiguous().view(-1), flat_out, reduce)
        self._finish(output, flat_out)
        self.served += 1
        return self._done([output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs):  # noqa: A001
            self._allgather_base(output, input, opts).wait()
        return self._done(list(outputs))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs):  # noqa: A001
            self._reduce_scatter_base(output, input, opts).wait()
        return self._done(list(outputs))

    def _equal_splits(self, splits, rows: int) -> bool:
        return not splits or (len(splits) == self.n and all(int(s) * self.n == rows for s in splits))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        rows = input.shape[0] if input.dim() else 0
        if not (self._equal_splits(output_split_sizes, rows) and self._equal_splits(input_split_sizes, rows)) \
                or not self._local(input, output) or input.numel() != output.numel() or input.numel() % self.n:
            return self.fallback.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)
        flat_out, chunk = self._flat_out(output), input.numel() // self.n

        def gather(lo, hi, parts):
            for j, p in enumerate(parts):
                flat_out[j * chunk + lo:j * chunk + hi] = p

        self._mine(input.contiguous().view(-1), flat_out, gather)
        self._finish(output, flat_out)
        self.served += 1
        return self._done([output])

    def barrier(self, opts=None):
        self._exchange(torch.zeros(1, dtype=torch.int8))
        self.served += 1
        return self._done([])

    def close(self) -> None:
        self.segment.close()


def _wanted() -> str | None:
    """Why this process will not use shared memory (None: it would)."""
    if os.environ.get(ENV, "shm") == "gloo":
        return f"{ENV}=gloo"
    if EXTENSION.load() is None:
        return EXTENSION.reason or "the helper did not build"
    return None


def _timeout_s(group: dist.ProcessGroup) -> float:
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - torch internals; the default below is safe
        return 600.0


def wrap(group: dist.ProcessGroup) -> tuple[dist.ProcessGroup, str]:
    """``(group to register, note)``: a :class:`SharedMemoryGroup` over ``group`` where every member
    is on this host and can use it, else ``group`` itself. Collective over ``group``: every member
    calls it at the same point. Undo with :func:`release`."""
    ranks = dist.get_process_group_ranks(group)  # global, in group-rank order
    if len(ranks) == 1 or dist.get_backend(group) != "gloo":
        return group, "one member or not gloo"
    host = (socket.gethostname(), Path("/proc/sys/kernel/random/boot_id").read_text().strip()
            if Path("/proc/sys/kernel/random/boot_id").exists() else "")
    why = _wanted()
    seen: list = [None] * len(ranks)
    dist.all_gather_object(seen, (host, why), group=group)
    refusals = sorted({w for _, w in seen if w})
    if refusals or len({h for h, _ in seen}) != 1:
        return group, f"gloo: {refusals[0] if refusals else 'members on different hosts'}"
    # whole cache lines (so every slot starts aligned for any dtype), at least one
    slot_bytes = max(LINE, int(float(os.environ.get(SLOT_ENV, SLOT_MIB)) * (1 << 20)) // LINE * LINE)
    me = dist.get_rank(group)
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = [None]
    segment = None
    if me == 0:
        try:
            path[0] = os.path.join(directory, f"dcpgraph-collectives-{uuid.uuid4().hex}")
            segment = Segment(path[0], len(ranks), slot_bytes, create=True)
        except OSError as err:
            with contextlib.suppress(OSError):
                os.unlink(path[0])
            path[0], why = None, f"gloo: the shared segment could not be created ({err})"
    dist.broadcast_object_list(path, src=ranks[0], group=group)
    if path[0] is None:
        return group, why if me == 0 else "gloo: the shared segment could not be created"
    if me != 0:
        segment = Segment(path[0], len(ranks), slot_bytes, create=False)
    segment.header[(len(ranks) + me) * FLAG_STRIDE] = os.getpid()
    dist.barrier(group=group)  # every member mapped it and wrote its pid: the name can go
    if me == 0:
        os.unlink(path[0])
    return SharedMemoryGroup(group, segment, _timeout_s(group), EXTENSION.module), "shared memory"


def release(group: dist.ProcessGroup) -> None:
    """Unmap what :func:`wrap` mapped for ``group`` (nothing for a group it left as it was)."""
    if isinstance(group, SharedMemoryGroup):
        group.close()
