"""End to end: DeepSeek-V3.2 sparse attention under TP and DCP with a sharded indexer equals HF.

Model: :mod:`sfa_models` (``index_topk`` 4, prompts of 1, 3, 6 and 19 tokens plus 12 generated, so
every request outgrows the selection). Reference: HF ``generate(do_sample=False)`` prompt by
prompt. Runs (emulated): every valid ``(tp, dcp)`` with tp, dcp in {1, 2, 4} (MLA rule
``tp % dcp == 0``); each ``dcp > 1`` mesh with interleave 1 and interleave ``block_size`` and with
both comms between them (the comm of the interleave-1 run alternates over meshes). ``block_size``
4 and ``max_num_batched_tokens`` 8: the 19-token prompt is prefilled in chunks mixed with decode rows,
and prompts of 1 and 3 tokens are shorter than ``dcp·interleave`` for several runs (some ranks
own none of their keys at first). The full matrix is ``slow``; ``tp=2, dcp=2`` runs by default.

Also: both caches are sharded (per-rank KV bytes per token exactly ``1/dcp`` of the tp-only run,
and ``capacity.cache_shapes`` counts the index cache), prefix caching through the Engine, and
speculative decoding (prompt-lookup drafts verified as a multi-token query).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import sfa_models
import torch

import dcpgraph
from dcpgraph import capacity
from dcpgraph.testing.generation import hf_greedy

BLOCK = 4
MAX_NEW = 12
MESHES = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]


def _cases():
    cases, sharded = [], 0
    for tp, dcp in MESHES:
        if dcp == 1:
            cases.append((tp, dcp, 1, "a2a"))
            continue
        first = ("a2a", "ag_rs")[sharded % 2]
        second = ("ag_rs", "a2a")[sharded % 2]
        cases += [(tp, dcp, 1, first), (tp, dcp, BLOCK, second)]
        sharded += 1
    return cases


CASES = _cases()
FAST = {(2, 2, 1, "a2a")}


class Setup(sfa_models.TracedWithReferences):
    def __init__(self):
        super().__init__(MAX_NEW)

    def engine(self, tp, dcp, interleave=1, comm="auto", **kw):
        kw.setdefault("num_blocks", 40)
        return dcpgraph.compile(self.program, tp=tp, dcp=dcp, interleave=interleave, comm=comm,
                                block_size=BLOCK, max_num_batched_tokens=8, **kw)


@pytest.fixture(scope="module")
def setup() -> Setup:
    return Setup()


def test_the_case_selection_covers_meshes_interleaves_and_comms():
    assert {(tp, dcp) for tp, dcp, _, _ in CASES} == set(MESHES)
    sharded = [c for c in CASES if c[1] > 1]
    assert {(il, comm) for _, _, il, comm in sharded} == {(1, "a2a"), (1, "ag_rs"), (BLOCK, "a2a"), (BLOCK, "ag_rs")}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=() if c in FAST else pytest.mark.slow) for c in CASES],
    ids=[f"tp{c[0]}-dcp{c[1]}-il{c[2]}-{c[3]}" for c in CASES],
)
def test_greedy_tokens_equal_hf(setup, case):
    tp, dcp, interleave, comm = case
    engine = setup.engine(tp, dcp, interleave, comm)
    assert engine.report()["comm"] == (comm if dcp > 1 else "none")
    got = engine.generate([list(p) for p in sfa_models.PROMPTS], MAX_NEW)
    for prompt, tokens in zip(sfa_models.PROMPTS, got):
        assert tokens == setup.ref(prompt), f"prompt of length {len(prompt)}"
    report = engine.report()
    assert report["decode_buckets"] and sum(report["graph_steps"].values()) > 0  # padded decode buckets ran


@pytest.mark.parametrize("tp, dcp, interleave, comm", [(1, 1, 1, "a2a"), (2, 2, BLOCK, "ag_rs"),
                                                   pytest.param(4, 2, 1, "a2a", marks=pytest.mark.slow)])
def test_greedy_tokens_equal_hf_with_and_without_mlapo(setup, tp, dcp, interleave, comm):
    """MLAPO (on by default) fuses V3.2's MLA preprocess and leaves the indexer's own cache write
    alone; off, the program keeps every op. Both give HF's tokens."""
    for mlapo in (True, False):
        engine = setup.engine(tp, dcp, interleave, comm, mlapo=mlapo)
        fused = sum(1 for n in engine.program.graph_module.graph.nodes
                    if n.target is torch.ops.dcpgraph.mla_preprocess.default)
        assert fused == (sfa_models.LAYERS if mlapo else 0), (mlapo, fused)
        got = engine.generate([list(p) for p in sfa_models.PROMPTS], MAX_NEW)
        for prompt, tokens in zip(sfa_models.PROMPTS, got):
            assert tokens == setup.ref(prompt), (mlapo, len(prompt))


def test_both_caches_are_sharded_exactly_by_dcp(setup):
    """Latent and indexer-key caches per layer; per-rank bytes per token at dcp=2 and 4 are exactly
    1/dcp of the tp-only engine's, and ``capacity.cache_shapes`` counts both."""
    base = setup.engine(4, 1, num_blocks=8)
    names = sorted(c.name for c in base.program.caches)
    assert names == sorted(f"{kind}_cache_{i}" for i in range(sfa_models.LAYERS) for kind in ("latent", "index"))
    roles = {c.role for c in base.program.caches}
    assert roles == {"latent", "index_k"}
    shapes = capacity.cache_shapes(base.program.caches)
    per_token = sfa_models.LAYERS * (sfa_models.KV_LORA_RANK + sfa_models.ROPE + sfa_models.INDEX_DIM) * 8
    assert sum(s.bytes_per_token for s in shapes) == per_token
    assert capacity.bytes_per_token(shapes, BLOCK, 1) == per_token
    assert base.memory_report()["kv_bytes_per_token"] == per_token
    for dcp in (2, 4):
        sharded = setup.engine(4, dcp, num_blocks=8)
        assert Fraction(sharded.memory_report()["kv_bytes_per_token"]) == Fraction(per_token, dcp)
        assert capacity.bytes_per_token(capacity.cache_shapes(sharded.program.caches), BLOCK, dcp) == Fraction(
            per_token, dcp)


def test_planner_shape_of_deepseek_v32_counts_both_caches_and_divides_by_dcp():
    """The planner's DeepSeek-V3.2 shape (61 layers; latent 512+64, indexer key 128): per-rank KV
    bytes per token with DCP are exactly 1/dcp of tp-only, index cache included."""
    from dcpgraph.plan.architectures import ARCHITECTURES
    from dcpgraph.plan.model_shape import from_config

    shape = from_config(ARCHITECTURES["deepseek-v3.2"])
    shapes = shape.cache_shapes(8)
    assert len(shapes) == 2 * 61 and {s.dim for s in shapes} == {576, 128}
    tp_only = capacity.bytes_per_token(shapes, 128, 1)
    assert tp_only == 61 * (576 * 2 + 128 + 4)  # bf16 latent + fp8 index key with its fp32 scale
    for dcp in (2, 4, 8):
        assert capacity.bytes_per_token(shapes, 128, dcp) == tp_only / dcp


def test_each_rank_writes_only_its_share_of_both_caches(setup):
    engine = setup.engine(2, 2, interleave=1)
    prompt = list(sfa_models.PROMPTS[3])
    got = engine.generate([prompt], MAX_NEW)[0]
    assert got == setup.ref(prompt)
    total = len(prompt) + len(got) - 1  # the last sampled token is never fed back
    for rank in engine.mesh.ranks:
        caches = engine.executor.caches[rank]
        for i in range(sfa_models.LAYERS):
            for name in (f"latent_cache_{i}", f"index_cache_{i}"):
                written = int((caches[name].abs().sum(-1) > 0).sum())
                assert written == dcpgraph.layout.local_len(total, engine.mesh.dcp_rank(rank), 2, 1), (rank, name)


@pytest.mark.parametrize(("tp", "dcp", "interleave"), [(2, 2, BLOCK), (1, 1, 1)])
def test_prefix_caching_reuses_both_caches_and_equals_hf(setup, tp, dcp, interleave):
    prefix = [(11 * i + 5) % sfa_models.VOCAB for i in range(18)]
    rounds = ([prefix + [1, 2]], [prefix + [3], prefix[:10] + [4, 5]])
    engine = setup.engine(tp, dcp, interleave, enable_prefix_caching=True)
    for prompts in rounds:
        assert engine.generate(prompts, MAX_NEW) == [setup.ref(p) for p in prompts]
    stats = engine.report()["prefix_cache"]
    assert stats["hit_tokens"] >= (len(prefix) // (BLOCK * dcp)) * BLOCK * dcp > 0


def test_speculative_decoding_equals_hf(setup):
    prompts = [[246, 236, 236, 236, 236], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]]  # their outputs repeat n-grams
    engine = setup.engine(2, 2, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert engine.generate(prompts, MAX_NEW) == [setup.ref(p) for p in prompts]
    stats = engine.report()["speculative"]
    assert stats["drafted"] > 0 and stats["accepted"] > 0  # drafts verified through the sparse path


@pytest.mark.parametrize(("tp", "dcp", "interleave", "comm"), [(2, 2, 1, "a2a"), (4, 2, BLOCK, "ag_rs")])
def test_glm5_with_a_shared_indexer_layer_equals_hf(tp, dcp, interleave, comm):
    """GLM-5 (``glm_moe_dsa``): layer 1 reuses layer 0's top-k, so it has a latent cache only and
    reads layer 0's (sharded, merged) selection."""
    model = sfa_models.build("glm_moe_dsa", indexer_types=["full", "shared"])
    engine = dcpgraph.compile(model, tp=tp, dcp=dcp, interleave=interleave, comm=comm, block_size=BLOCK,
                              max_num_batched_tokens=8, num_blocks=40)
    assert sorted(c.name for c in engine.program.caches) == ["index_cache_0", "latent_cache_0", "latent_cache_1"]
    got = engine.generate([list(p) for p in sfa_models.PROMPTS], MAX_NEW)
    assert got == [hf_greedy(model, p, MAX_NEW) for p in sfa_models.PROMPTS]


def test_an_fp8_cache_is_refused_by_name(setup):
    with pytest.raises(dcpgraph.ConfigError, match="fp8_e4m3.*sparse"):
        setup.engine(1, 1, kv_cache_dtype="fp8_e4m3")


def test_the_program_shows_the_sharded_indexer(setup):
    engine = setup.engine(2, 2)
    graph = engine.program.graph_module.graph
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    ops = torch.ops.dcpgraph
    assert targets.count(ops.paged_indexer_topk.default) == targets.count(ops.merge_topk.default) == sfa_models.LAYERS
    assert targets.count(ops.paged_sparse_attention.default) == sfa_models.LAYERS
    assert ops.paged_attention.default not in targets and ops.indexer_topk.default not in targets


@pytest.mark.parametrize(
    "prefill, decode",
    [
        (dict(dcp=1, interleave=1), dict(dcp=2, interleave=BLOCK)),
        (dict(dcp=2, interleave=1), dict(dcp=1, interleave=1)),
    ],
    ids=["dcp1-to-dcp2", "dcp2-to-dcp1"],
)
def test_pd_transfer_moves_both_caches(setup, prefill, decode):
    """Prefill on one layout, export the KV (latent and indexer-key caches), decode on another."""
    from dcpgraph.testing.generation import drain

    prompts = [list(sfa_models.PROMPTS[3]), list(sfa_models.PROMPTS[1])]
    p_engine = setup.engine(2, **prefill)
    d_engine = setup.engine(2, **decode)
    transfers = [p_engine.prefill(p) for p in prompts]
    for t in transfers:
        assert {name for name in t.caches[0]} == {c.name for c in p_engine.program.caches}
    ids = [d_engine.continue_from(t, MAX_NEW) for t in transfers]
    outputs = drain(d_engine)
    got = [list(t.tokens[t.prompt_len:]) + outputs[rid] for t, rid in zip(transfers, ids)]
    assert got == [setup.ref(p) for p in prompts]
