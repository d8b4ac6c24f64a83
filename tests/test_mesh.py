"""The device mesh (``dcpgraph.mesh``; docs/architecture.md, Mesh and constraints): DCP groups, and which (tp, dcp, model) settings
are accepted, checked against the rules of the vLLM Ascend Decode Context Parallel Guide."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcpgraph.errors import ConfigError, DcpGraphError
from dcpgraph.mesh import Mesh
from dcpgraph.testing import strategies as dst

# -- groups ---------------------------------------------------------------------------------------
GROUPS = [
    # tp, dcp, expected DCP groups
    (1, 1, [(0,)]),
    (2, 2, [(0, 1)]),
    (4, 1, [(0,), (1,), (2,), (3,)]),
    (8, 2, [(0, 1), (2, 3), (4, 5), (6, 7)]),
    (8, 4, [(0, 1, 2, 3), (4, 5, 6, 7)]),
    (8, 8, [tuple(range(8))]),
    (6, 3, [(0, 1, 2), (3, 4, 5)]),
    (12, 4, [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]),
]


@pytest.mark.parametrize("tp, dcp, groups", GROUPS)
def test_dcp_groups_are_consecutive_runs(tp, dcp, groups):
    mesh = Mesh(tp=tp, dcp=dcp)
    assert mesh.world_size == tp  # DCP adds no ranks
    assert list(mesh.ranks) == list(range(tp))
    assert mesh.dcp_groups() == groups
    for group in groups:
        for position, rank in enumerate(group):
            assert mesh.dcp_group(rank) == group
            assert mesh.group("dcp", rank) == group
            assert mesh.dcp_rank(rank) == position
            assert mesh.tp_group(rank) == mesh.group("tp", rank) == tuple(range(tp))
            assert mesh.tp_rank(rank) == rank


def test_tp8_dcp2_example_from_the_design():
    mesh = Mesh(tp=8, dcp=2)
    assert mesh.dcp_groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [mesh.dcp_rank(r) for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert "{0,1} {2,3} {4,5} {6,7}" in str(mesh)


@given(cfg=dst.attention_configs(), data=st.data())
def test_groups_partition_the_world_and_sit_inside_kv_replica_sets(cfg, data):
    mesh = data.draw(dst.meshes(cfg))
    groups = mesh.dcp_groups()
    assert sorted(r for g in groups for r in g) == list(range(mesh.tp))
    assert all(len(g) == mesh.dcp for g in groups)
    if cfg.kind == "gqa" and mesh.dcp > 1:
        # KV head k is replicated on ranks [k·tp/n_kv, (k+1)·tp/n_kv): one head per group
        replicas = mesh.tp // cfg.num_kv_heads
        for g in groups:
            assert len({rank // replicas for rank in g}) == 1, g


@pytest.mark.parametrize("rank", [-1, 8, 100])
def test_rank_outside_the_mesh_is_refused(rank):
    mesh = Mesh(tp=8, dcp=2)
    for fn in (mesh.dcp_group, mesh.dcp_rank, mesh.tp_group, mesh.tp_rank):
        with pytest.raises(ValueError, match="outside the mesh"):
            fn(rank)


def test_unknown_group_kind_is_refused():
    with pytest.raises(ValueError, match="'tp', 'dcp', 'pcp' or 'ep'"):
        Mesh(tp=2).group("pp", 0)


@pytest.mark.parametrize(
    "kwargs", [{"tp": 0}, {"tp": -2}, {"tp": 2.0}, {"tp": True}, {"tp": 2, "dcp": 0}, {"tp": 2, "pcp": 0}]
)
def test_non_positive_or_non_int_sizes_are_refused(kwargs):
    with pytest.raises(ConfigError, match="must be a positive int"):
        Mesh(**kwargs)


def test_mesh_is_frozen_and_hashable():
    mesh = Mesh(tp=4, dcp=2)
    assert mesh == Mesh(tp=4, dcp=2) and hash(mesh) == hash(Mesh(tp=4, dcp=2))
    with pytest.raises(AttributeError):
        mesh.dcp = 4  # type: ignore[misc]


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
    assert issubclass(ConfigError, DcpGraphError)
    with pytest.raises(ValueError):
        Mesh(tp=8, dcp=4).validate(attention="gqa", num_q_heads=64, num_kv_heads=4)


# -- validate: accepted -------------------------------------------------------------------------
MLA = {"attention": "mla"}
VALID = [
    # id, (tp, dcp), validate(**kwargs)
    ("DeepSeek-V2-Lite tp2 dcp2 (the guide's example)", (2, 2), dict(MLA, num_q_heads=16)),
    ("DeepSeek-V2-Lite tp2 dcp2 interleave=block=128 (KV transfer)", (2, 2),
     dict(MLA, num_q_heads=16, block_size=128, interleave=128)),
    ("DeepSeek-V2-Lite tp2 dcp1", (2, 1), dict(MLA, num_q_heads=16)),
    ("DeepSeek-V2-Lite tp16 dcp16", (16, 16), dict(MLA, num_q_heads=16)),
    ("DeepSeek-R1 tp16 dcp8", (16, 8), dict(MLA, num_q_heads=128)),
    ("DeepSeek-R1 tp8 dcp8", (8, 8), dict(MLA, num_q_heads=128)),
    ("MLA tp6 dcp3", (6, 3), dict(MLA, num_q_heads=12)),
    ("Qwen3-235B tp8 dcp1", (8, 1), {"attention": "gqa", "num_q_heads": 64, "num_kv_heads": 4}),
    ("Qwen3-235B tp8 dcp2", (8, 2), {"attention": "gqa", "num_q_heads": 64, "num_kv_heads": 4}),
    ("Qwen3-235B tp16 dcp4", (16, 4), {"attention": "gqa", "num_q_heads": 64, "num_kv_heads": 4}),
    ("Qwen3-235B tp16 dcp2", (16, 2), {"attention": "gqa", "num_q_heads": 64, "num_kv_heads": 4}),
    ("Qwen3-235B tp4 dcp1 (KV heads split, no DCP)", (4, 1),
     {"attention": "gqa", "num_q_heads": 64, "num_kv_heads": 4}),
    ("Qwen3-235B tp2 dcp1 (2 KV heads per rank)", (2, 1),
     {"attention": "gqa", "num_q_heads": 64, "num_kv_heads": 4}),
    ("MQA tp8 dcp8", (8, 8), {"attention": "gqa", "num_q_heads": 8, "num_kv_heads": 1}),
    ("GQA kv=3 tp6 dcp2", (6, 2), {"attention": "gqa", "num_q_heads": 12, "num_kv_heads": 3}),
    ("GQA kv=2 tp12 dcp3", (12, 3), {"attention": "gqa", "num_q_heads": 24, "num_kv_heads": 2}),
    ("GQA kv=2 tp12 dcp6", (12, 6), {"attention": "gqa", "num_q_heads": 24, "num_kv_heads": 2}),
    ("block 64 interleave 16", (2, 2), dict(MLA, num_q_heads=16, block_size=64, interleave=16)),
    ("block 48 interleave 3", (2, 2), dict(MLA, num_q_heads=16, block_size=48, interleave=3)),
]


@pytest.mark.parametrize("mesh_args, kwargs", [v[1:] for v in VALID], ids=[v[0] for v in VALID])
def test_valid_settings_are_accepted(mesh_args, kwargs):
    tp, dcp = mesh_args
    mesh = Mesh(tp=tp, dcp=dcp)
    assert mesh.validate(**kwargs) is mesh


# -- validate: refused --------------------------------------------------------------------------
QWEN3 = {"attention": "gqa", "num_q_heads": 64, "num_kv_heads": 4}
INVALID = [
    # id, (tp, dcp, pcp), validate(**kwargs), regexes the message must match
    ("Qwen3-235B tp8 dcp4: replica set of 2 < dcp", (8, 4, 1), QWEN3,
     [r"tp // num_kv_heads", r"replicated on tp // num_kv_heads = 2 ranks", r"Valid dcp at tp=8: \[1, 2\]"]),
    ("Qwen3-235B tp8 dcp8", (8, 8, 1), QWEN3, [r"tp // num_kv_heads", r"\[1, 2\]"]),
    ("GQA kv=2 tp12 dcp4: 6 % 4 != 0", (12, 4, 1),
     {"attention": "gqa", "num_q_heads": 24, "num_kv_heads": 2},
     [r"\(tp // num_kv_heads\) % dcp == 0", r"Valid dcp at tp=12: \[1, 2, 3, 6\]"]),
    ("Qwen3-235B tp4 dcp2: tp == num_kv_heads", (4, 2, 1), QWEN3,
     [r"tp=4 <= num_kv_heads=4", r"replication", r"dcp=1"]),
    ("Qwen3-235B tp2 dcp2: tp < num_kv_heads", (2, 2, 1), QWEN3,
     [r"tp=2 <= num_kv_heads=4", r"replication", r"dcp=1"]),
    ("MHA tp8 dcp2: every rank has its own heads", (8, 2, 1),
     {"attention": "gqa", "num_q_heads": 32, "num_kv_heads": 32}, [r"replication"]),
    ("MLA tp4 dcp3", (4, 3, 1), dict(MLA, num_q_heads=16),
     [r"tp % dcp == 0", r"valid dcp: \[1, 2, 4\]"]),
    ("MLA tp2 dcp4: dcp > tp", (2, 4, 1), dict(MLA, num_q_heads=16),
     [r"tp % dcp == 0", r"valid dcp: \[1, 2\]"]),
    ("MLA tp2 pcp2 dcp3", (2, 3, 2), dict(MLA, num_q_heads=16),
     [r"\(tp · pcp\) % dcp == 0", r"tp·pcp = 4 attention ranks", r"valid dcp: \[1, 2, 4\]"]),
    ("GQA kv=2 tp2 pcp2 dcp4", (2, 4, 2), {"attention": "gqa", "num_q_heads": 4, "num_kv_heads": 2},
     [r"max\(tp // num_kv_heads, 1\) · pcp", r"Valid dcp at tp=2, pcp=2: \[1, 2\]"]),
    ("Qwen3-235B tp8 pcp2 dcp8", (8, 8, 2), QWEN3, [r"= 4 attention ranks", r"\[1, 2, 4\]"]),
    ("block 16 interleave 3", (2, 2, 1), dict(MLA, num_q_heads=16, block_size=16, interleave=3),
     [r"block_size % interleave == 0", r"valid interleaves for this block size: \[1, 2, 4, 8, 16\]"]),
    ("block 128 interleave 256", (2, 2, 1), dict(MLA, num_q_heads=16, block_size=128, interleave=256),
     [r"block_size % interleave == 0"]),
    ("block 0", (2, 2, 1), dict(MLA, num_q_heads=16, block_size=0), [r"block_size"]),
    ("interleave 0", (2, 2, 1), dict(MLA, num_q_heads=16, interleave=0), [r"interleave"]),
    ("num_q_heads 12 at tp8", (8, 1, 1), dict(MLA, num_q_heads=12),
     [r"num_q_heads % tp == 0", r"valid tp: \[1, 2, 3, 4, 6, 12\]"]),
    ("GQA num_q_heads 28 at tp8", (8, 2, 1), {"attention": "gqa", "num_q_heads": 28, "num_kv_heads": 4},
     [r"num_q_heads % tp == 0"]),
    ("kv 3 at tp2", (2, 1, 1), {"attention": "gqa", "num_q_heads": 6, "num_kv_heads": 3},
     [r"num_kv_heads % tp == 0 or tp % num_kv_heads == 0", r"valid tp: \[1, 3, 6\]"]),
    ("kv 6 at tp4", (4, 2, 1), {"attention": "gqa", "num_q_heads": 24, "num_kv_heads": 6},
     [r"num_kv_heads % tp == 0 or tp % num_kv_heads == 0", r"valid tp: \[1, 2, 3, 6, 12\]"]),
    ("q not a multiple of kv", (2, 1, 1), {"attention": "gqa", "num_q_heads": 12, "num_kv_heads": 5},
     [r"multiple of num_kv_heads"]),
    ("GQA without num_kv_heads", (2, 1, 1), {"attention": "gqa", "num_q_heads": 8},
     [r"num_kv_heads"]),
    ("GQA with num_kv_heads 0", (2, 1, 1), {"attention": "gqa", "num_q_heads": 8, "num_kv_heads": 0},
     [r"num_kv_heads"]),
    ("unknown attention kind", (2, 1, 1), {"attention": "mha", "num_q_heads": 8},
     [r"'mla' or 'gqa'"]),
]


@pytest.mark.parametrize(
    "mesh_args, kwargs, patterns", [v[1:] for v in INVALID], ids=[v[0] for v in INVALID]
)
def test_invalid_settings_are_refused_naming_the_rule(mesh_args, kwargs, patterns):
    tp, dcp, pcp = mesh_args
    with pytest.raises(ConfigError) as info:
        Mesh(tp=tp, dcp=dcp, pcp=pcp).validate(**kwargs)
    message = str(info.value)
    for pattern in patterns:
        assert re.search(pattern, message), f"{pattern!r} not in {message!r}"


# -- validate against an independent statement of the rules -------------------------------------
def guide_accepts(cfg: dst.AttentionConfig, tp, dcp, pcp, block_size, interleave) -> bool:
    """The rules written out once more, straight from the guide and docs/architecture.md (Mesh and constraints)."""
    if block_size % interleave or cfg.num_q_heads % tp:
        return False
    if cfg.kind == "mla":
        return (tp * pcp) % dcp == 0 and (pcp > 1 or tp >= dcp)
    if cfg.num_q_heads % cfg.num_kv_heads:
        return False
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        return False
    if pcp > 1:  # KV head k lives on its TP replica set times every PCP replica
        return (max(tp // cfg.num_kv_heads, 1) * pcp) % dcp == 0
    if tp % dcp:
        return False
    n_kv = cfg.num_kv_heads
    return dcp == 1 or ((tp // n_kv) >= dcp and (tp // n_kv) % dcp == 0)


_LISTED = re.compile(r"[Vv]alid (dcp|tp|interleaves)\b[^:\[]*: \[([\d, ]*)\]")


@given(
    cfg=dst.attention_configs(max_q_heads=64),
    tp=st.integers(1, 16),
    dcp=st.integers(1, 16),
    pcp=st.sampled_from([1, 1, 1, 2]),
    interleave=dst.interleaves() | st.integers(1, 20),
    block_size=st.sampled_from([16, 64, 128]) | st.integers(1, 160),
)
def test_validate_agrees_with_the_guide_and_errors_are_actionable(
    cfg, tp, dcp, pcp, interleave, block_size
):
    def attempt(tp=tp, dcp=dcp, pcp=pcp, interleave=interleave, block_size=block_size):
        mesh = Mesh(tp=tp, dcp=dcp, pcp=pcp)
        kwargs = dict(attention=cfg.kind, num_q_heads=cfg.num_q_heads, block_size=block_size,
                      interleave=interleave)
        if cfg.kind == "gqa":
            kwargs["num_kv_heads"] = cfg.num_kv_heads
        try:
            mesh.validate(**kwargs)
        except ConfigError as err:
            return str(err)
        return None

    expected = guide_accepts(cfg, tp, dcp, pcp, block_size, interleave)
    message = attempt()
    assert (message is None) == expected, message
    if message is None:
        return
    rule = message.split(":")[0]
    listed = _LISTED.search(message)
    if listed is None:
        return
    name, values = listed.group(1), [int(v) for v in listed.group(2).split(",") if v.strip()]
    field = {"dcp": "dcp", "tp": "tp", "interleaves": "interleave"}[name]
    assert values, message
    for value in values:
        # each setting the message offers clears this rule (another rule may still fail)
        other = attempt(**{field: value})
        assert other is None or other.split(":")[0] != rule, (value, message, other)


@given(cfg=dst.attention_configs(), data=st.data())
def test_attention_configs_and_meshes_strategies_are_consistent(cfg, data):
    assert cfg.num_q_heads >= 1 and cfg.head_dim >= 1 and cfg.value_dim >= 1
    assert cfg.num_q_heads % cfg.num_kv_heads == 0
    if cfg.kind == "mla":
        assert cfg.num_kv_heads == 1 and cfg.value_dim <= cfg.head_dim
    mesh = data.draw(dst.meshes(cfg))
    kwargs = {"num_kv_heads": cfg.num_kv_heads} if cfg.kind == "gqa" else {}
    assert mesh.validate(attention=cfg.kind, num_q_heads=cfg.num_q_heads, **kwargs) is mesh
