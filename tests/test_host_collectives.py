"""Shared-memory collectives on real processes: every functional collective a graph issues gives
the emulator's exact result (the collective registry's semantics, a by-hand reference), also when
its payload goes in slot-sized pieces, what it does not serve goes through gloo with the same
result, a dead peer is an error in the survivors rather than a hang, and
``DCPGRAPH_HOST_COLLECTIVES=gloo`` turns it off."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from dcpgraph import Mesh
from dcpgraph.collectives import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    DCP_GROUP,
    REDUCE_SCATTER,
    TP_GROUP,
    bind,
)
from dcpgraph.runtime.distributed import spawn

pytestmark = pytest.mark.gloo
c10d = torch.ops._c10d_functional


def _inputs(rank: int, dtype: torch.dtype, rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(rows, 3, 5, generator=gen) * 4).to(dtype)


def _calls(x: torch.Tensor, n: int, group: str):
    """(name, registry entry, functional call args) of every collective, over ``group``."""
    return [
        ("all_reduce sum", ALL_REDUCE, (x, "sum", group)),
        ("all_reduce max", ALL_REDUCE, (x, "max", group)),
        ("all_reduce avg", ALL_REDUCE, (x, "avg" if x.is_floating_point() else "bxor", group)),
        ("all_gather", ALL_GATHER, (x, n, group)),
        ("reduce_scatter sum", REDUCE_SCATTER, (x, "sum", n, group)),
        ("all_to_all", ALL_TO_ALL, (x, [x.shape[0] // n] * n, [x.shape[0] // n] * n, group)),
    ]


SLOT_1_MIB = "1"  # small segments: fits a container's 64 MiB /dev/shm
SLOT_64_BYTES = str(64 / (1 << 20))  # every payload below in pieces, their bounds across the chunks


def _run_every_collective(rank: int, world: int, dcp: int, dtype_name: str, rows: int, slot_mib: str):
    from dcpgraph.runtime.distributed import register_mesh_groups, transports

    os.environ["DCPGRAPH_HOST_COLLECTIVE_SLOT_MIB"] = slot_mib  # in the rank: forked ranks keep the fork server's env
    mesh = Mesh(world, dcp)
    register_mesh_groups(mesh)
    dtype = getattr(torch, dtype_name)
    x = _inputs(rank, dtype, rows)
    out = {}
    for group, n in ((TP_GROUP, world), (DCP_GROUP, dcp)):
        for name, coll, args in _calls(x, n, group):
            out[(group, name)] = c10d.wait_tensor(coll.op(*args))
    from torch._C._distributed_c10d import _resolve_process_group

    served = {g: getattr(_resolve_process_group(g), "served", None) for g in (TP_GROUP, DCP_GROUP)}
    return out, transports(), served


def _expected(world: int, dcp: int, dtype: torch.dtype, rows: int):
    """The emulator's semantics (the registry's ``emulate``) over every group, per rank."""
    mesh = Mesh(world, dcp)
    xs = [_inputs(r, dtype, rows) for r in range(world)]
    want = [{} for _ in range(world)]
    for group, kind, n in ((TP_GROUP, "tp", world), (DCP_GROUP, "dcp", dcp)):
        for members in {mesh.group(kind, r) for r in range(world)}:
            calls = {r: _calls(xs[r], n, group) for r in members}
            for i, (name, coll, _) in enumerate(calls[members[0]]):
                params = [bind(coll.op, calls[r][i][2], {}) for r in members]
                for r, result in zip(members, coll.emulate(params)):
                    want[r][(group, name)] = result
    return want


@pytest.mark.parametrize(("world", "dcp", "dtype", "rows", "slot_mib"), [
    (2, 2, "float32", 4, SLOT_1_MIB), (2, 1, "bfloat16", 2, SLOT_1_MIB), (4, 2, "float32", 8, SLOT_1_MIB),
    (2, 2, "int64", 6, SLOT_1_MIB),
    # pieces of 16 fp32 / 8 int64 / 32 bf16 elements: 8 pieces over 4 chunks of 30, 12 over 2 of 45, 2 of 60
    (4, 2, "float32", 8, SLOT_64_BYTES), (2, 2, "int64", 6, SLOT_64_BYTES), (2, 1, "bfloat16", 4, SLOT_64_BYTES),
])
def test_every_collective_equals_the_emulators_semantics(world, dcp, dtype, rows, slot_mib):
    results = spawn(_run_every_collective, world, dcp, dtype, rows, slot_mib, timeout_s=240)
    want = _expected(world, dcp, getattr(torch, dtype), rows)
    for rank, (got, transport, served) in enumerate(results):
        assert transport["tp"] == "shared memory", transport
        assert transport["dcp"] == ("shared memory" if dcp > 1 else "one member or not gloo"), transport
        assert served[TP_GROUP] == 6 and (dcp == 1 or served[DCP_GROUP] == 6), served
        for key, value in want[rank].items():
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert torch.equal(got[key], value), (rank, key)


def _larger_than_a_slot(rank: int, world: int):
    from dcpgraph.runtime.distributed import register_mesh_groups

    os.environ["DCPGRAPH_HOST_COLLECTIVE_SLOT_MIB"] = "1"  # in the rank: forked ranks keep the fork server's env
    register_mesh_groups(Mesh(world, 1))
    x = torch.arange(300_000, dtype=torch.float32) * (rank + 1)  # 1.2 MB: two pieces of a 1 MiB slot
    total = c10d.wait_tensor(c10d.all_reduce(x, "sum", TP_GROUP))
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(x, world, TP_GROUP))
    from torch._C._distributed_c10d import _resolve_process_group

    group = _resolve_process_group(TP_GROUP)
    return total, gathered, group.served, group.seq


def test_a_payload_larger_than_a_slot_goes_in_pieces():
    x = torch.arange(300_000, dtype=torch.float32)
    for total, gathered, served, exchanges in spawn(_larger_than_a_slot, 2, timeout_s=240):
        assert torch.equal(total, x + 2 * x)
        assert torch.equal(gathered, torch.cat([x, 2 * x]))
        assert served == 2 and exchanges == 4  # two collectives, two pieces each


def _transport(rank: int, world: int, env: dict):
    from dcpgraph.runtime.distributed import register_mesh_groups, transports

    os.environ.update(env)  # in the rank: forked ranks keep the fork server's env
    register_mesh_groups(Mesh(world, world))
    y = c10d.wait_tensor(c10d.all_reduce(torch.ones(2) * rank, "sum", DCP_GROUP))
    return transports(), y.tolist()


def test_gloo_when_asked():
    for transport, y in spawn(_transport, 2, {"DCPGRAPH_HOST_COLLECTIVES": "gloo"}, timeout_s=240):
        assert transport == {"tp": "gloo: DCPGRAPH_HOST_COLLECTIVES=gloo", "dcp": "gloo: DCPGRAPH_HOST_COLLECTIVES=gloo"}
        assert y == [1.0, 1.0]


def test_gloo_when_the_segment_cannot_be_reserved():
    """A segment larger than /dev/shm can hold is refused at set-up (posix_fallocate), never a
    SIGBUS in the middle of a step; the ranks agree on gloo and keep working."""
    huge = {"DCPGRAPH_HOST_COLLECTIVE_SLOT_MIB": str(1 << 30)}  # a PiB per slot
    results = spawn(_transport, 2, huge, timeout_s=240)
    for transport, y in results:
        assert all(note.startswith("gloo: the shared segment could not be created") for note in transport.values())
        assert y == [1.0, 1.0]
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("dcpgraph-collectives-")]


def _one_rank_dies(rank: int, port: int, report: str) -> None:
    """Launched by hand (spawn would kill the survivor as soon as it saw the dead rank)."""
    import datetime

    import torch.distributed as dist

    from dcpgraph.runtime.distributed import register_mesh_groups

    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=60))
    register_mesh_groups(Mesh(2, 1))
    c10d.wait_tensor(c10d.all_reduce(torch.ones(2), "sum", TP_GROUP))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        c10d.wait_tensor(c10d.all_reduce(torch.ones(2), "sum", TP_GROUP))
        outcome = "returned"
    except RuntimeError as err:
        outcome = f"{time.monotonic() - start:.3f} s: {err}"
    with open(report, "w") as f:
        f.write(outcome)
    os._exit(0)  # no teardown: the world has a dead member


def test_a_dead_peer_is_an_error_in_the_survivor_not_a_hang(tmp_path):
    import torch.multiprocessing as mp

    from dcpgraph.runtime.ports import free_port

    report, port = tmp_path / "rank0.txt", free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_one_rank_dies, args=(r, port, str(report)), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        procs[0].join(90)
        assert procs[0].exitcode == 0, "the survivor hung or crashed"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    seconds, _, message = report.read_text().partition(" s: ")
    assert "exited while group rank 0 waited for it in shared-memory collective #2" in message
    assert float(seconds) < 5
