"""The SPMD emulator (``dcpgraph.runtime.emulator``) and the gloo runtime run the same graphs.

1. Each collective kind, emulated, against a hand-written loop over ranks.
2. The same GraphModules on real gloo processes give identical (``torch.equal``) outputs.
3. Ranks that disagree raise ``CollectiveMismatchError`` instead of hanging.
4. Determinism, bit-exact non-collective evaluation, torch.export graphs.

Graph builders are module-level functions of ``(mesh, kind, rank)`` so that spawned gloo ranks can
rebuild exactly the graphs the emulator runs. Values that get reduced are small integers stored in
floats, so the sum is exact in any order (gloo's reduction order is not group-rank order).
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
from hypothesis import given
from hypothesis import strategies as st

from dcpgraph.collectives import DCP_GROUP, TP_GROUP, group_kind, group_name
from dcpgraph.errors import CollectiveMismatchError
from dcpgraph.mesh import Mesh
from dcpgraph.runtime import (
    register_mesh_groups,
    run_distributed_graph,
    run_spmd,
    spawn,
)

F = torch.ops._c10d_functional
trace = torch.fx.symbolic_trace


# -- graph builders and inputs --------------------------------------------------------------------
def _size(mesh: Mesh, kind: str, rank: int) -> int:
    return len(mesh.group(kind, rank))


def _ints(rank: int, salt: int, *shape: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + salt)
    return torch.randint(-20, 20, shape, generator=gen).to(torch.float32)


def _floats(rank: int, salt: int, *shape: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + salt)
    return torch.randn(shape, generator=gen)


def build_all_gather(mesh, kind, rank):
    n, name = _size(mesh, kind, rank), group_name(kind)

    def f(x):
        return F.wait_tensor(F.all_gather_into_tensor(x + 1, n, name)) * 2

    return trace(f)


def build_reduce_scatter(mesh, kind, rank, op="sum"):
    n, name = _size(mesh, kind, rank), group_name(kind)

    def f(x):
        return F.wait_tensor(F.reduce_scatter_tensor(x, op, n, name))

    return trace(f)


def build_all_reduce(mesh, kind, rank, op="sum"):
    name = group_name(kind)

    def f(x):
        return F.wait_tensor(F.all_reduce(x * 3, op, name)) - 1

    return trace(f)


def build_all_to_all(mesh, kind, rank):
    n, name = _size(mesh, kind, rank), group_name(kind)

    def f(x):
        return F.wait_tensor(F.all_to_all_single(x, [2] * n, [2] * n, name))

    return trace(f)


def _split(i: int, j: int) -> int:
    """Rows group-rank i sends to group-rank j (unequal, some zero)."""
    return (i + 2 * j) % 3


def build_all_to_all_uneven(mesh, kind, rank):
    group, name = mesh.group(kind, rank), group_name(kind)
    me, n = group.index(rank), len(group)
    outs, ins = [_split(j, me) for j in range(n)], [_split(me, j) for j in range(n)]

    def f(x):
        return F.wait_tensor(F.all_to_all_single(x, outs, ins, name))

    return trace(f)


def build_chain(mesh, kind, rank):
    """tp all_reduce -> dcp reduce_scatter -> tp all_gather -> dcp all_to_all; nested output."""
    tp, dcp = mesh.tp, mesh.dcp

    def f(x):
        a = F.wait_tensor(F.all_reduce(x, "sum", TP_GROUP))
        b = F.wait_tensor(F.reduce_scatter_tensor(a, "sum", dcp, DCP_GROUP))
        c = F.wait_tensor(F.all_gather_into_tensor(b + 1, tp, TP_GROUP))
        d = F.all_to_all_single(c, [c.shape[0] // dcp] * dcp, [c.shape[0] // dcp] * dcp, DCP_GROUP)
        return F.wait_tensor(d), [b, {"c": c}]

    return trace(f)


def build(case: str, mesh: Mesh, kind: str, rank: int) -> torch.fx.GraphModule:
    name, _, op = case.partition(":")
    builder = BUILDERS[name]
    return builder(mesh, kind, rank, op) if op else builder(mesh, kind, rank)


def inputs(case: str, mesh: Mesh, kind: str, rank: int) -> tuple:
    n = _size(mesh, kind, rank)
    name = case.partition(":")[0]
    if name == "all_gather":
        return (_floats(rank, 1, 3, 2),)
    if name == "reduce_scatter":
        return (_ints(rank, 2, 2 * n, 3),)
    if name == "all_reduce":
        return (_ints(rank, 3, 2, 5) if "product" not in case else _ints(rank, 3, 4) % 4,)
    if name == "all_to_all":
        return (_floats(rank, 4, 2 * n, 3),)
    if name == "all_to_all_uneven":
        group = mesh.group(kind, rank)
        rows = sum(_split(group.index(rank), j) for j in range(n))
        return (_floats(rank, 5, rows, 2),)
    if name == "chain":
        return (_ints(rank, 6, 2 * mesh.dcp, 2),)
    raise KeyError(case)


BUILDERS = {
    "all_gather": build_all_gather,
    "reduce_scatter": build_reduce_scatter,
    "all_reduce": build_all_reduce,
    "all_to_all": build_all_to_all,
    "all_to_all_uneven": build_all_to_all_uneven,
    "chain": build_chain,
}
CASES = [
    "all_gather",
    "reduce_scatter:sum",
    "reduce_scatter:max",
    "all_reduce:sum",
    "all_reduce:avg",
    "all_reduce:min",
    "all_reduce:product",
    "all_to_all",
    "all_to_all_uneven",
]
KINDS = ("tp", "dcp")


# -- hand-written references: loops over ranks ---------------------------------------------------
_REDUCERS = {
    "sum": operator.add,
    "avg": operator.add,
    "max": torch.maximum,
    "min": torch.minimum,
    "product": operator.mul,
}


def _reduce(op: str, xs: list[torch.Tensor]) -> torch.Tensor:
    acc = xs[0]
    for x in xs[1:]:
        acc = _REDUCERS[op](acc, x)
    return acc / len(xs) if op == "avg" else acc


def expected(case: str, mesh: Mesh, kind: str, args: list[tuple]) -> list:
    """Per-rank outputs of ``case``, computed rank by rank with torch.cat / sums."""
    name, _, op = case.partition(":")
    outs = []
    for rank in mesh.ranks:
        group = mesh.group(kind, rank)
        me, n = group.index(rank), len(group)
        xs = [args[r][0] for r in group]
        if name == "all_gather":
            outs.append(torch.cat([x + 1 for x in xs]) * 2)
        elif name == "reduce_scatter":
            total = _reduce(op, xs)
            outs.append(total[me * total.shape[0] // n:(me + 1) * total.shape[0] // n])
        elif name == "all_reduce":
            outs.append(_reduce(op, [x * 3 for x in xs]) - 1)
        elif name == "all_to_all":
            outs.append(torch.cat([x[2 * me:2 * me + 2] for x in xs]))
        elif name == "all_to_all_uneven":
            pieces = []
            for i, x in enumerate(xs):
                start = sum(_split(i, j) for j in range(me))
                pieces.append(x[start:start + _split(i, me)])
            outs.append(torch.cat(pieces))
        elif name == "chain":
            outs.append(_expected_chain(mesh, args, rank))
        else:
            raise KeyError(case)
    return outs


def _expected_chain(mesh: Mesh, args: list[tuple], rank: int):
    a = sum(args[r][0] for r in mesh.ranks)  # tp all_reduce: the same on every rank
    rows = a.shape[0] // mesh.dcp
    b = {r: a[mesh.dcp_rank(r) * rows:(mesh.dcp_rank(r) + 1) * rows] * mesh.dcp for r in mesh.ranks}
    c = torch.cat([b[r] + 1 for r in mesh.ranks])  # tp all_gather: the same on every rank
    per = c.shape[0] // mesh.dcp
    me = mesh.dcp_rank(rank)
    d = torch.cat([c[me * per:(me + 1) * per] for _ in mesh.dcp_group(rank)])
    return d, [b[rank], {"c": c}]


def assert_same(actual, wanted, where=""):
    """Exact equality (``torch.equal``) through nested tuples / lists / dicts."""
    if isinstance(wanted, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == wanted.dtype and torch.equal(actual, wanted), (where, actual, wanted)
    elif isinstance(wanted, dict):
        assert isinstance(actual, dict) and actual.keys() == wanted.keys(), where
        for key in wanted:
            assert_same(actual[key], wanted[key], f"{where}[{key!r}]")
    elif isinstance(wanted, (list, tuple)):
        assert type(actual) is type(wanted) and len(actual) == len(wanted), where
        for i, (x, y) in enumerate(zip(actual, wanted)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert actual == wanted, where


def emulate(case: str, mesh: Mesh, kind: str) -> list:
    graphs = [build(case, mesh, kind, r) for r in mesh.ranks]
    return run_spmd(graphs, [inputs(case, mesh, kind, r) for r in mesh.ranks], mesh)


MESHES = [Mesh(1), Mesh(2, 1), Mesh(2, 2), Mesh(4, 1), Mesh(4, 2), Mesh(4, 4), Mesh(8, 4)]


# -- 1. each collective against the reference ----------------------------------------------------
@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_collective_matches_reference(case, mesh, kind):
    args = [inputs(case, mesh, kind, r) for r in mesh.ranks]
    got = emulate(case, mesh, kind)
    for rank, (out, want) in enumerate(zip(got, expected(case, mesh, kind, args))):
        assert_same(out, want, f"rank {rank}")


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_chain_of_collectives_on_both_groups(mesh):
    args = [inputs("chain", mesh, "tp", r) for r in mesh.ranks]
    got = run_spmd(build("chain", mesh, "tp", 0), args, mesh)  # one graph for every rank
    for rank, (out, want) in enumerate(zip(got, expected("chain", mesh, "tp", args))):
        assert_same(out, want, f"rank {rank}")


def test_results_are_fresh_tensors_per_rank():
    mesh = Mesh(2, 2)
    x = torch.ones(2)
    outs = run_spmd(trace(lambda t: F.wait_tensor(F.all_reduce(t, "sum", DCP_GROUP))),
                    [(x,), (x,)], mesh)
    assert outs[0] is not outs[1] and outs[0].data_ptr() != outs[1].data_ptr()
    outs[0].add_(1)
    assert torch.equal(outs[1], torch.full((2,), 2.0)) and torch.equal(x, torch.ones(2))


@given(
    n=st.integers(1, 4),
    splits=st.lists(st.integers(0, 3), min_size=16, max_size=16),
    cols=st.integers(1, 3),
)
def test_all_to_all_any_split_matrix(n, splits, cols):
    """Rank i sends S[i][j] rows to rank j; rank j receives them in rank order."""
    s = [[splits[4 * i + j] for j in range(n)] for i in range(n)]
    mesh = Mesh(n, n)
    graphs, args = [], []
    for i in range(n):
        outs, ins = [s[j][i] for j in range(n)], [s[i][j] for j in range(n)]
        graphs.append(trace(
            lambda x, o=outs, i_=ins: F.wait_tensor(F.all_to_all_single(x, o, i_, DCP_GROUP))
        ))
        args.append((torch.arange(sum(ins) * cols, dtype=torch.float64).view(-1, cols) + 100 * i,))
    got = run_spmd(graphs, args, mesh)
    for j in range(n):
        pieces = []
        for i in range(n):
            start = sum(s[i][:j])
            pieces.append(args[i][0][start:start + s[i][j]])
        assert torch.equal(got[j], torch.cat(pieces))


# -- non-collective evaluation is gm(*args), bit for bit ----------------------------------------
class _Block(torch.nn.Module):
    """call_module, get_attr, call_method, kwargs, list arguments and a nested output."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.randn(8))
        self.register_buffer("bias", torch.randn(8))

    def forward(self, x, mask):
        h = self.proj(x).softmax(dim=-1) * self.scale
        h = torch.where(mask, h, torch.zeros_like(h)).cumsum(-1)
        both = torch.cat([h, x], dim=1).transpose(0, 1).contiguous()
        return {"h": h + self.bias, "g": (both.mean(), [both.max(dim=0)])}


def test_non_collective_nodes_match_gm_call_exactly():
    torch.manual_seed(0)
    gm = trace(_Block())
    mesh = Mesh(2)
    args = [(torch.randn(5, 8), torch.rand(5, 8) > 0.3) for _ in mesh.ranks]
    with torch.no_grad():
        got = run_spmd(gm, args, mesh)
        for rank in mesh.ranks:
            assert_same(got[rank], gm(*args[rank]), f"rank {rank}")


def test_export_graph_with_pytree_inputs_and_outputs():
    class M(torch.nn.Module):
        def forward(self, x, d):
            a = F.wait_tensor(F.all_gather_into_tensor(x * 2, 2, DCP_GROUP))
            return {"a": a, "rest": [a + d["z"].sum(), (x,)]}

    ep = torch.export.export(M(), (torch.randn(3, 2), {"z": torch.randn(4)}))
    gm = ep.module()
    mesh = Mesh(4, 2)
    args = [(torch.randn(3, 2), {"z": torch.randn(4)}) for _ in mesh.ranks]
    got = run_spmd(gm, args, mesh)
    for rank in mesh.ranks:
        a = torch.cat([args[r][0] * 2 for r in mesh.dcp_group(rank)])
        want = {"a": a, "rest": [a + args[rank][1]["z"].sum(), (args[rank][0],)]}
        assert_same(got[rank], want, f"rank {rank}")


def test_plan_cache_follows_recompile():
    gm = trace(lambda x: F.wait_tensor(F.all_reduce(x, "sum", TP_GROUP)) + 1)
    mesh = Mesh(2)
    args = [(torch.ones(2),), (torch.ones(2),)]
    assert torch.equal(run_spmd(gm, args, mesh)[0], torch.full((2,), 3.0))
    for node in gm.graph.nodes:
        if node.target is operator.add:
            node.args = (node.args[0], 10)
    gm.recompile()
    assert torch.equal(run_spmd(gm, args, mesh)[0], torch.full((2,), 12.0))


def test_independent_groups_progress_separately():
    """DCP group {0,1} runs a collective that {2,3} never runs; then all meet on the TP group."""
    mesh = Mesh(4, 2)

    def busy(x):
        y = F.wait_tensor(F.all_gather_into_tensor(x, 2, DCP_GROUP)).sum(0, keepdim=True)
        return F.wait_tensor(F.all_reduce(y, "sum", TP_GROUP))

    def idle(x):
        return F.wait_tensor(F.all_reduce(x * 0, "sum", TP_GROUP))

    graphs = [trace(busy), trace(busy), trace(idle), trace(idle)]
    got = run_spmd(graphs, [(torch.full((1, 2), float(r)),) for r in mesh.ranks], mesh)
    for out in got:
        assert torch.equal(out, torch.full((1, 2), 2.0))  # (0 + 1) on each of ranks 0, 1


def test_deterministic_and_in_group_rank_order():
    mesh = Mesh(4, 4)
    gm = trace(lambda x: F.wait_tensor(F.all_reduce(x, "sum", DCP_GROUP)))
    args = [(torch.randn(64, generator=torch.Generator().manual_seed(r)) * 1e3,) for r in range(4)]
    first = run_spmd(gm, args, mesh)
    again = run_spmd(gm, args, mesh)
    xs = [a[0] for a in args]
    in_order = ((xs[0] + xs[1]) + xs[2]) + xs[3]
    for a, b in zip(first, again):
        assert torch.equal(a, b) and torch.equal(a, in_order)


# -- 3. mismatches raise, never hang -------------------------------------------------------------
def _gather(x):
    return F.wait_tensor(F.all_gather_into_tensor(x, 2, TP_GROUP))


def _allreduce(x):
    return F.wait_tensor(F.all_reduce(x, "sum", TP_GROUP))


def test_different_collectives_raise():
    with pytest.raises(CollectiveMismatchError) as info:
        run_spmd([trace(_gather), trace(_allreduce)], [(torch.ones(2),)] * 2, Mesh(2))
    msg = str(info.value)
    assert "rank 0" in msg and "rank 1" in msg and "all_gather_into_tensor" in msg
    assert "all_reduce" in msg


def test_rank_that_returned_while_peer_waits_raises():
    with pytest.raises(CollectiveMismatchError, match="rank 1 has returned"):
        run_spmd([trace(_allreduce), trace(lambda x: x)], [(torch.ones(2),)] * 2, Mesh(2))


def test_tp_and_dcp_on_the_same_ranks_do_not_match():
    dcp = trace(lambda x: F.wait_tensor(F.all_reduce(x, "sum", DCP_GROUP)))
    with pytest.raises(CollectiveMismatchError, match="no collective can start"):
        run_spmd([trace(_allreduce), dcp], [(torch.ones(2),)] * 2, Mesh(2, 2))


def test_shape_mismatch_raises():
    with pytest.raises(CollectiveMismatchError, match="input shape"):
        run_spmd(trace(_allreduce), [(torch.ones(2),), (torch.ones(3),)], Mesh(2))


def test_wrong_group_size_raises():
    with pytest.raises(CollectiveMismatchError, match="group_size=2"):
        run_spmd(trace(_gather), [(torch.ones(2),)] * 4, Mesh(4))


def test_inconsistent_all_to_all_splits_raise():
    graphs = [
        trace(lambda x: F.wait_tensor(F.all_to_all_single(x, [1, 1], [1, 1], TP_GROUP))),
        trace(lambda x: F.wait_tensor(F.all_to_all_single(x, [1, 1], [2, 0], TP_GROUP))),
    ]
    with pytest.raises(CollectiveMismatchError, match="split sizes do not match"):
        run_spmd(graphs, [(torch.ones(2),)] * 2, Mesh(2))


def test_unknown_group_name_raises():
    assert group_kind(TP_GROUP) == "tp" and group_kind(DCP_GROUP) == "dcp"
    with pytest.raises(ValueError, match="unknown process-group name"):
        group_kind("0")
    bad = trace(lambda x: F.wait_tensor(F.all_reduce(x, "sum", "default")))
    with pytest.raises(ValueError, match="rank 0.*unknown process-group name"):
        run_spmd(bad, [(torch.ones(1),)], Mesh(1))


def test_unsupported_collective_raises():
    gm = trace(lambda x: F.wait_tensor(F.broadcast(x, 0, TP_GROUP)))
    with pytest.raises(NotImplementedError, match="broadcast"):
        run_spmd(gm, [(torch.ones(1),)], Mesh(1))


# -- 2. the same graphs on real gloo processes -----------------------------------------------------
GLOO_CASES = [*CASES, "chain"]


def gloo_worker(rank: int, world_size: int, meshes: list[tuple[int, int]]) -> dict:
    """Run every case on this rank under torch.distributed; switch meshes in the same world."""
    outs = {}
    for tp, dcp in meshes:
        mesh = Mesh(tp, dcp)
        groups = register_mesh_groups(mesh)
        assert register_mesh_groups(mesh) == groups  # idempotent: no new groups
        assert groups["dcp"].size() == dcp and groups["tp"].size() == tp
        for case in GLOO_CASES:
            for kind in KINDS if case != "chain" else ("tp",):
                gm = build(case, mesh, kind, rank)
                args = inputs(case, mesh, kind, rank)
                outs[tp, dcp, case, kind] = run_distributed_graph(gm, args)
    return outs


def _check_gloo(world_size: int, meshes: list[tuple[int, int]]) -> None:
    per_rank = spawn(gloo_worker, world_size, meshes, timeout_s=120)
    for key in per_rank[0]:
        tp, dcp, case, kind = key
        emulated = emulate(case, Mesh(tp, dcp), kind)
        for rank in range(world_size):
            assert_same(per_rank[rank][key], emulated[rank], f"{key} rank {rank}")


@pytest.mark.gloo
def test_gloo_world_of_2_matches_emulator():
    _check_gloo(2, [(2, 2), (2, 1)])


@pytest.mark.gloo
def test_gloo_world_of_4_matches_emulator():
    _check_gloo(4, [(4, 2), (4, 4), (4, 1)])


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


@pytest.mark.gloo
def test_spawn_reports_the_failing_rank():
    from dcpgraph.runtime import RankFailedError

    with pytest.raises(RankFailedError, match="(?s)rank 1 failed.*boom on rank 1"):
        spawn(_raise_on_rank_1, 2, timeout_s=60)


def _sleep_forever(rank: int, world_size: int) -> None:
    import time

    time.sleep(600)


@pytest.mark.gloo
def test_spawn_times_out_instead_of_hanging():
    import time

    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish"):
        spawn(_sleep_forever, 2, timeout_s=3)
    assert time.monotonic() - start < 30
