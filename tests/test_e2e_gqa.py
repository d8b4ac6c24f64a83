"""End-to-end acceptance tests of the GQA slice: HF model → ``dcpgraph.compile`` → ``Engine``.

Models: tiny Llama (1 KV head), Qwen3 (q/k RMSNorm, 2 KV heads) and Qwen2 (q/k/v bias, 1 KV
head), 8 query heads, 2 layers, hidden 64, vocab 128, random fp64 weights with a large
``initializer_range`` so that greedy outputs are varied rather than one repeated token. The HF
init leaves biases at 0 and norm weights at 1, which would make the bias/norm paths vacuous, so
:func:`build_model` redraws them. Reference: HF ``generate(do_sample=False)`` run prompt by prompt
on the same weights (computed once per model and prompt, cached). fp64 makes TP/DCP reduction order
irrelevant to argmax.

Config selection for the greedy test (:func:`covering_selection`, deterministic):

* every valid ``(tp, dcp)`` in ``{1,2,4}²`` of every model, enumerated with ``Mesh.validate``
  (Llama/Qwen2: (1,1) (2,1) (2,2) (4,1) (4,2) (4,4); Qwen3: (1,1) (2,1) (4,1) (4,2));
* ``dcp == 1``: one run per pair. The layout and the program do not depend on ``interleave`` or
  ``comm`` there (shard_dcp is a no-op), so those are only rotated for variety;
* ``dcp > 1``: three runs per pair, one per interleave in ``{1, 2, block_size}``, with ``comm``
  alternating ``a2a``/``ag_rs`` and the alternation's phase shifted by one for each successive
  ``dcp > 1`` pair of a model (and by the model's index). So each such pair sees every interleave
  and both comms, and every model with ≥ 2 such pairs sees all 6 ``(interleave, comm)`` combinations.

``DCPGRAPH_E2E_FULL=1`` runs the full product instead (every interleave × comm for every valid
pair, also at dcp=1). Every run uses one batch of prompts of lengths 1, 3, 7, 13, 21 (several
shorter than ``dcp · interleave``; 21 > ``max_num_batched_tokens`` = 8 so prefill is chunked and mixed
with decode rows), ``block_size`` 4 and 24 new tokens: at dcp=1 every request crosses ≥ 5 block
boundaries; even at dcp=4 (16-token virtual blocks) the longest spans 3 virtual blocks, and on every rank
crosses at least one physical block boundary (two on most).

Also covered: KV bytes per token/per rank against dcp=1 (Llama, Qwen3; Qwen2's KV shapes are
Llama's); the caches really are sharded (each rank
holds exactly its ``layout.local_len`` share); invalid meshes raise ``ConfigError`` before tracing
or any pass; bad prompts raise ``RequestError`` and the engine keeps serving; seeded sampling is
reproducible and mesh-independent; continuous batching (requests added between steps, a small
cache that forces block reuse, ``max_num_seqs`` limits) still gives HF's tokens.
"""

from __future__ import annotations

import itertools
import os
from fractions import Fraction

import pytest
import torch
from gqa_models import (
    BLOCK_SIZE,
    COMMON,
    COMMS,
    EOS,
    EXPECTED_VALID,
    INTERLEAVES,
    MAX_BATCHED,
    MAX_NEW,
    MODELS,
    PROMPTS,
    VOCAB,
    build_model,
)

import dcpgraph
from dcpgraph import ConfigError, Mesh, RequestError, layout
from dcpgraph.api import facts_of
from dcpgraph.testing.generation import drain, hf_greedy


def valid_meshes(name: str) -> list[tuple[int, int]]:
    extra = MODELS[name][2]
    valid = []
    for tp, dcp in itertools.product((1, 2, 4), repeat=2):
        try:
            Mesh(tp, dcp).validate(attention="gqa", num_q_heads=COMMON["num_attention_heads"],
                                   num_kv_heads=extra["num_key_value_heads"], block_size=BLOCK_SIZE)
        except ConfigError:
            continue
        valid.append((tp, dcp))
    return valid


def covering_selection(full: bool = False) -> list[tuple[str, int, int, int, str]]:
    """``(model, tp, dcp, interleave, comm)`` runs; see the module docstring."""
    cases = []
    for m_index, name in enumerate(MODELS):
        sharded = 0
        for k, (tp, dcp) in enumerate(valid_meshes(name)):
            if full:
                cases += [(name, tp, dcp, i, c) for i in INTERLEAVES for c in COMMS]
            elif dcp == 1:
                cases.append((name, tp, dcp, INTERLEAVES[k % 3], COMMS[(k + m_index) % 2]))
            else:
                phase = m_index + sharded
                cases += [(name, tp, dcp, il, COMMS[(j + phase) % 2]) for j, il in enumerate(INTERLEAVES)]
                sharded += 1
    return cases


CASES = covering_selection(full=os.environ.get("DCPGRAPH_E2E_FULL") == "1")


# -- fixtures -----------------------------------------------------------------------------------
class Zoo:
    """Each model built and traced once; HF references cached per (model, prompt)."""

    def __init__(self) -> None:
        self._models: dict[str, torch.nn.Module] = {}
        self._programs: dict = {}
        self._refs: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def model(self, name: str) -> torch.nn.Module:
        if name not in self._models:
            self._models[name] = build_model(name)
        return self._models[name]

    def program(self, name: str):
        if name not in self._programs:
            self._programs[name] = dcpgraph.trace(self.model(name))
        return self._programs[name]

    def reference(self, name: str, prompt, max_new_tokens: int = MAX_NEW) -> list[int]:
        """HF's greedy tokens (a greedy run of n tokens is a prefix of a longer one)."""
        key = (name, tuple(prompt))
        if key not in self._refs:
            self._refs[key] = hf_greedy(self.model(name), prompt, max(MAX_NEW, max_new_tokens))
        return self._refs[key][:max_new_tokens]

    def engine(self, name: str, tp: int, dcp: int, **kw):
        kw = {"block_size": BLOCK_SIZE, "max_num_batched_tokens": MAX_BATCHED, "comm": "a2a", **kw}
        return dcpgraph.compile(self.program(name), tp=tp, dcp=dcp, **kw)


@pytest.fixture(scope="module")
def zoo() -> Zoo:
    return Zoo()


# -- the selection itself -------------------------------------------------------------------------
def test_valid_meshes_and_the_selection_covers_them(zoo):
    for name in MODELS:
        assert valid_meshes(name) == EXPECTED_VALID[name], name
        facts = facts_of(zoo.program(name))
        assert (facts.attention, facts.num_q_heads, facts.num_kv_heads, facts.num_layers) == (
            "gqa", 8, MODELS[name][2]["num_key_value_heads"], 2)
        assert facts.eos_token_id == (EOS,)
        runs = [c[1:] for c in CASES if c[0] == name]
        assert {(tp, dcp) for tp, dcp, _, _ in runs} == set(EXPECTED_VALID[name])
        pairs = [(tp, dcp) for tp, dcp in EXPECTED_VALID[name] if dcp > 1]
        for tp, dcp in pairs:
            mine = [(i, c) for t, d, i, c in runs if (t, d) == (tp, dcp)]
            assert {i for i, _ in mine} == set(INTERLEAVES) and {c for _, c in mine} == set(COMMS)
        if len(pairs) >= 2:
            combos = {(i, c) for t, d, i, c in runs if d > 1}
            assert combos == set(itertools.product(INTERLEAVES, COMMS)), name
    # the prompts really are shorter than dcp·interleave for the sharded runs, and chunked
    lengths = sorted(len(p) for p in PROMPTS)
    assert lengths[0] == 1 and lengths[-1] > MAX_BATCHED
    assert any(len(p) < 2 * 2 for p in PROMPTS) and sum(len(p) < 4 * BLOCK_SIZE for p in PROMPTS) >= 3


def test_references_are_not_degenerate(zoo):
    """A model whose greedy output is one repeated token would make the comparison weak; one
    reference stopping at EOS (after crossing blocks) covers the engine's EOS handling."""
    stopped = 0
    for name in MODELS:
        refs = [zoo.reference(name, p) for p in PROMPTS]
        assert all(len(r) >= 16 and len(set(r)) >= 6 for r in refs), (name, refs)
        stopped += sum(len(r) < MAX_NEW and r[-1] == EOS for r in refs)
    assert stopped >= 1


# -- greedy tokens equal HF's -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "tp", "dcp", "interleave", "comm"), CASES,
    ids=[f"{n}-tp{t}-dcp{d}-il{i}-{c}" for n, t, d, i, c in CASES],
)
def test_greedy_matches_hf(zoo, name, tp, dcp, interleave, comm):
    engine = zoo.engine(name, tp, dcp, interleave=interleave, comm=comm)
    got = engine.generate([list(p) for p in PROMPTS], MAX_NEW)
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == zoo.reference(name, prompt), f"prompt of length {len(prompt)}"
    report = engine.report()
    assert report["executor"] == "emulated"
    assert report["comm"] == (comm if dcp > 1 else "none")
    assert engine.blocks.free_blocks == engine.blocks.num_blocks  # everything released
    assert not engine.scheduler.has_work()
    assert engine.steps >= MAX_NEW + 2  # prefill was chunked (21 tokens over an 8-token budget)


SPLIT_CASES = [("llama", 4, 4, 1, "a2a"), ("qwen3", 4, 2, 2, "ag_rs"), ("llama", 2, 2, BLOCK_SIZE, "ag"),
               ("qwen2", 2, 1, 1, "a2a")]


@pytest.mark.parametrize(("name", "tp", "dcp", "interleave", "comm"), SPLIT_CASES,
                         ids=[f"{n}-tp{t}-dcp{d}-il{i}-{c}" for n, t, d, i, c in SPLIT_CASES])
def test_the_split_new_token_form_matches_hf_too(zoo, name, tp, dcp, interleave, comm):
    """``fuse_new_tokens=False`` (what the Ascend backends build: a separate new-token attention,
    merged after the DCP merge) gives HF's tokens as the default fused read does."""
    engine = zoo.engine(name, tp, dcp, interleave=interleave, comm=comm, fuse_new_tokens=False)
    ops = [n.target for n in engine.program.graph_module.graph.nodes]
    assert ops.count(torch.ops.dcpgraph.partial_attention.default) == 2  # one a layer
    got = engine.generate([list(p) for p in PROMPTS], MAX_NEW)
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == zoo.reference(name, prompt), f"prompt of length {len(prompt)}"


FUSED_CASES = [("qwen2", 2, 2, 1, "a2a")]  # q/k/v with biases split by head, gate/up split: both fuse


@pytest.mark.parametrize(("name", "tp", "dcp", "interleave", "comm"), FUSED_CASES,
                         ids=[f"{n}-tp{t}-dcp{d}-il{i}-{c}" for n, t, d, i, c in FUSED_CASES])
def test_fused_sibling_linears_match_hf_too(zoo, name, tp, dcp, interleave, comm):
    """``fuse_linears=True`` (off by default): each layer's q/k/v and gate/up run as one linear over
    each rank's concatenated shards, and the tokens are still HF's."""
    engine = zoo.engine(name, tp, dcp, interleave=interleave, comm=comm, fuse_linears=True)
    summary = next(p.summary for p in engine.program.provenance if p.name == "fuse_linears")
    assert summary.startswith("10 linears → 4"), summary  # 2 layers: q/k/v → 1, gate/up → 1
    got = engine.generate([list(p) for p in PROMPTS], MAX_NEW)
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == zoo.reference(name, prompt), f"prompt of length {len(prompt)}"


# -- KV memory ------------------------------------------------------------------------------------
def _allocated(engine, rank: int) -> int:
    return sum(t.numel() * t.element_size() for t in engine.executor.caches[rank].values())


@pytest.mark.parametrize("name", ["llama", "qwen3"])  # qwen2's KV shapes are llama's
def test_kv_bytes_scale_with_dcp(zoo, name):
    """At the same tp and token capacity, dcp=N costs 1/N of dcp=1 per token and per rank, and
    needs 1/N of the blocks; a physical block costs the same at every dcp, so at the same
    ``num_blocks`` the bytes per rank are equal and the capacity is N×. The reports match the
    tensors actually allocated. (``verify=False`` here: the option must work at dcp > 1 too.)"""
    tokens = 256  # a multiple of block_size · dcp for every dcp here
    tps = sorted({tp for tp, dcp in EXPECTED_VALID[name] if dcp > 1})
    assert tps
    for tp in tps:
        dcps = [d for t, d in EXPECTED_VALID[name] if t == tp]
        engines = {d: zoo.engine(name, tp, d, kv_cache_tokens=tokens, verify=False) for d in dcps}
        base = engines[1].memory_report()
        per_block = Fraction(base["kv_bytes_per_rank"][0], base["num_blocks"])
        for d, engine in engines.items():
            rep = engine.memory_report()
            assert (rep["tp"], rep["dcp"], rep["kv_capacity_tokens"]) == (tp, d, tokens)
            assert rep["num_blocks"] * d == base["num_blocks"]
            assert [b * d for b in rep["kv_bytes_per_rank"]] == base["kv_bytes_per_rank"]
            assert rep["kv_bytes_per_token"] * d == base["kv_bytes_per_token"]
            assert Fraction(rep["kv_bytes_per_rank"][0], rep["kv_capacity_tokens"]) * d == Fraction(
                base["kv_bytes_per_rank"][0], base["kv_capacity_tokens"])
            assert Fraction(rep["kv_bytes_per_rank"][0], rep["num_blocks"]) == per_block  # same num_blocks → same bytes
            assert rep["virtual_block_tokens"] == BLOCK_SIZE * d
            assert [_allocated(engine, r) for r in range(tp)] == rep["kv_bytes_per_rank"]


def _written_slots(engine, rank: int) -> torch.Tensor:
    """Boolean [num_blocks · block_size]: slots of ``rank`` that hold a (non-zero) KV entry."""
    written = None
    for cache in engine.executor.caches[rank].values():
        w = cache.reshape(cache.shape[0] * cache.shape[1], -1).abs().sum(-1) > 0
        written = w if written is None else written | w
    return written


@pytest.mark.parametrize(("name", "tp", "dcp", "interleave"),
                         [("llama", 4, 2, 2), ("llama", 4, 4, 1), ("qwen3", 4, 2, BLOCK_SIZE)])
def test_kv_cache_is_sharded_not_replicated(zoo, name, tp, dcp, interleave):
    """After one request, rank r of a DCP group holds exactly ``local_len(L, r)`` tokens, and
    ranks that hold the same KV head at the same DCP index hold the same cache."""
    prompt = PROMPTS[-1]
    engine = zoo.engine(name, tp, dcp, interleave=interleave)
    (out,) = engine.generate([list(prompt)], 12)
    assert out == zoo.reference(name, prompt, 12)
    written = len(prompt) + len(out) - 1  # the last sampled token is never fed back
    for rank in range(tp):
        d = engine.mesh.dcp_rank(rank)
        assert int(_written_slots(engine, rank).sum()) == layout.local_len(written, d, dcp, interleave)
    n_kv = MODELS[name][2]["num_key_value_heads"]
    replicas = tp // n_kv  # ranks [k·replicas, (k+1)·replicas) hold KV head k
    for rank in range(tp):
        twin = rank + dcp
        if twin < tp and twin // replicas == rank // replicas:
            for key, cache in engine.executor.caches[rank].items():
                assert torch.equal(cache, engine.executor.caches[twin][key]), (rank, twin, key)


# -- invalid configurations -------------------------------------------------------------------------
INVALID = [
    (name, tp, dcp, {})
    for name in MODELS
    for tp, dcp in itertools.product((1, 2, 4), repeat=2)
    if (tp, dcp) not in EXPECTED_VALID[name]
] + [
    ("llama", 3, 1, {}),  # 8 query heads over 3 ranks
    ("qwen3", 8, 8, {}),  # 8 // 2 = 4 replicas per KV head: a DCP group of 8 does not fit
    ("llama", 2, 2, {"interleave": 3}),  # block_size % interleave
    ("llama", 2, 0, {}),
    ("llama", 0, 1, {}),
]


def _invalid_ids():
    return [f"{n}-tp{t}-dcp{d}" + "".join(f"-{k}{v}" for k, v in kw.items()) for n, t, d, kw in INVALID]


@pytest.mark.parametrize(("name", "tp", "dcp", "kw"), INVALID, ids=_invalid_ids())
def test_invalid_mesh_raises_before_anything_runs(zoo, monkeypatch, name, tp, dcp, kw):
    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the configuration was checked")

    import dcpgraph.frontends.hf as hf
    import dcpgraph.passes.pipeline as pipeline

    models = (zoo.model(name), zoo.program(name))  # traced here, before tracing is forbidden
    monkeypatch.setattr(hf, "trace_hf", forbidden)
    monkeypatch.setattr(pipeline, "compile_program", forbidden)
    for model in models:  # the nn.Module is never traced
        with pytest.raises(ConfigError) as err:
            dcpgraph.compile(model, tp=tp, dcp=dcp, block_size=BLOCK_SIZE, **kw)
        assert "failed" in str(err.value) or "must" in str(err.value) or "num_kv_heads" in str(err.value)


# -- bad requests --------------------------------------------------------------------------------
def test_bad_prompts_raise_and_the_engine_keeps_serving(zoo):
    name = "llama"
    # capacity: 5 virtual blocks of 4·2 tokens = 40 tokens; max_model_len 48
    engine = zoo.engine(name, 2, 2, interleave=2, comm="ag_rs", num_blocks=5, max_model_len=48)
    good = [list(p) for p in PROMPTS]
    new = 12  # 21 + 12 = 33 tokens: one request at a time fits, so blocks are reused
    bad = [
        ([], "empty prompt"),
        ([1, VOCAB], r"outside the vocabulary \[0, 128\)"),
        ([-1, 5], "outside the vocabulary"),
        (list(range(3, 43)), "exceeds max_model_len=48"),  # 40 + 12 = 52 > 48
        ([7] * 35, "need 6 KV blocks; the cache has 5"),  # 47 <= 48 but > 40-token cache
    ]
    for i, (prompt, message) in enumerate(bad):
        steps = engine.steps
        with pytest.raises(RequestError, match=f"prompt 1: .*{message}"):
            engine.generate([good[i], prompt], new)  # the good one must not run either
        assert engine.steps == steps and not engine.scheduler.has_work()
        assert engine.blocks.free_blocks == engine.blocks.num_blocks
        with pytest.raises(RequestError, match=message):
            engine.add_request(prompt, new)
        assert not engine.scheduler.has_work()
        # same engine, next call: right tokens
        subset = [good[i], good[(i + 3) % len(good)]]
        assert engine.generate(subset, new) == [zoo.reference(name, p, new) for p in subset]
    with pytest.raises(RequestError, match="max_new_tokens"):
        engine.generate([good[0]], 0)
    assert engine.generate(good, new) == [zoo.reference(name, p, new) for p in good]


def test_bad_add_request_does_not_disturb_running_requests(zoo):
    name = "qwen2"
    engine = zoo.engine(name, 4, 2, interleave=BLOCK_SIZE, comm="ag_rs", max_model_len=64)
    outputs: dict[int, list[int]] = {}
    rids = {engine.add_request(list(p), MAX_NEW): p for p in PROMPTS[:3]}
    for _ in range(4):  # prompts in the cache, decoding under way
        for rid, token, _ in engine.step():
            outputs.setdefault(rid, []).append(token)
    assert all(outputs.get(r) for r in rids)
    for prompt, max_new in (([], 4), ([VOCAB + 5], 4), ([-3], 4), ([1] * 60, 10), ([1, 2], 0)):
        with pytest.raises(RequestError):
            engine.add_request(prompt, max_new)
    rid = engine.add_request(list(PROMPTS[3]), MAX_NEW)  # a valid one after the bad ones
    rids[rid] = PROMPTS[3]
    drain(engine, outputs)
    assert set(outputs) == set(rids)
    for r, prompt in rids.items():
        assert outputs[r] == zoo.reference(name, prompt), f"request {r}"


# -- sampling ------------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_and_mesh_independent(zoo):
    name = "qwen2"
    prompts = [list(p) for p in PROMPTS]
    n = 12
    params = dict(temperature=0.9, top_k=40, top_p=0.9, seed=1234)
    single = zoo.engine(name, 1, 1)
    a = single.generate(prompts, n, **params)
    assert single.generate(prompts, n, **params) == a  # same seed, same engine → same tokens
    sharded = zoo.engine(name, 2, 2, interleave=2)
    assert sharded.generate(prompts, n, **params) == a  # and the same on another mesh
    greedy = [zoo.reference(name, p, n) for p in prompts]
    assert a != greedy  # it really samples
    assert single.generate(prompts, n, **{**params, "seed": 99}) != a
    # add_request with the same seed: the same stream as the first prompt of a generate() call
    rid = single.add_request(prompts[0], n, **params)
    outputs: dict[int, list[int]] = {}
    drain(single, outputs)
    assert outputs[rid] == a[0]
    # top_k=1 and a vanishing top_p keep only the argmax: sampling degenerates to greedy
    assert sharded.generate(prompts, n, temperature=1.5, top_k=1, seed=5) == greedy
    assert sharded.generate(prompts, n, temperature=1.5, top_p=1e-9, seed=5) == greedy


# -- continuous batching -----------------------------------------------------------------------------
def test_requests_added_while_others_decode_match_hf(zoo):
    """Requests join between steps, while others decode; max_num_seqs=3 and a cache of 16
    virtual blocks (of 8 tokens; a request reserves 4–6) make later requests wait, then reuse
    blocks that earlier ones wrote."""
    name = "qwen3"
    engine = zoo.engine(name, 4, 2, interleave=2, comm="a2a", num_blocks=16, max_num_seqs=3,
                        max_model_len=64)
    outputs: dict[int, list[int]] = {}
    emitted_at: dict[int, list[int]] = {}
    prompts: dict[int, tuple[int, ...]] = {}

    def step():
        for rid, token, _ in engine.step():
            outputs.setdefault(rid, []).append(token)
            emitted_at.setdefault(rid, []).append(engine.steps)

    def add(prompt):
        rid = engine.add_request(list(prompt), MAX_NEW)
        prompts[rid] = prompt
        return rid

    a, b = add(PROMPTS[3]), add(PROMPTS[0])
    for _ in range(3):
        step()
    assert len(outputs[a]) >= 1 and len(outputs[b]) >= 2  # both decoding
    added_c = engine.steps
    c = add(PROMPTS[4])  # 21 tokens: prefilled over several steps next to the decode rows
    for _ in range(2):
        step()
    d, e = add(PROMPTS[1]), add(PROMPTS[2])  # d waits for a sequence slot
    tail = [add(p) for p in PROMPTS]  # and these for blocks
    for _ in range(500):
        if not engine.scheduler.has_work():
            break
        step()
    for rid, prompt in prompts.items():
        assert outputs[rid] == zoo.reference(name, prompt), f"request {rid} ({len(prompt)} tokens)"
    first_c = emitted_at[c][0]
    assert first_c > added_c + 1  # c's prefill took more than one step...
    assert any(added_c < s < first_c for s in emitted_at[a])  # ...during which a kept decoding
    first_done = min(emitted_at[r][-1] for r in (a, b, c))
    assert emitted_at[d][0] > first_done and emitted_at[e][0] > first_done  # they had to wait
    assert len(prompts) == 5 + len(tail) and engine.blocks.free_blocks == 16
