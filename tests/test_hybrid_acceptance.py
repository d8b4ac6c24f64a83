"""The hybrid acceptance matrix: each named hybrid (qwen3_5_text, qwen3_next, kimi_linear,
nemotron_h, granitemoehybrid, falcon_h1, minimax, lfm2; and bamba) in its mesh variant
(:data:`hybrid_models.ACCEPTANCE_MODELS`: transformers' classes and default implementations, fp32, weights
initialised at 0.2 rather than the default 0.02 so that greedy tokens differ between positions) gives HF ``generate``'s
greedy tokens

* with ``ngram`` speculation at tp=1 and tp4·dcp4 and a one-layer Llama ``draft_model`` at
  tp2·dcp2 (emulated), each through 8-token prefill chunks (the longest prompt is 13 tokens) and a
  KV cache small enough that a request is preempted and recomputed while the others verify drafts;
* with its state bytes per request, per rank, equal to the byte table of
  docs/user-guide/hybrid-models.md written out by hand below (not dcpgraph's own shape classes),
  divided by tp (every mesh here splits every recurrent layer), and the slots and snapshot rows counted per rank;
* with prefix caching hits that restore a kept recurrent state;
* on real gloo processes at tp2·dcp2 (one world serving all nine in turn).

Every mesh without speculation (tp4·dcp2 included), and the meshes that replicate a recurrent
layer, live in the per-kind files: tests/test_hybrid_mesh.py, test_mamba2_mesh.py,
test_kda_mesh.py, test_lightning_mesh.py.
"""

from __future__ import annotations

import pytest

import dcpgraph
from dcpgraph.testing.generation import drain, hf_greedy

transformers = pytest.importorskip("transformers")

from hybrid_models import ACCEPTANCE_MODELS, llama_draft, ngram  # noqa: E402 - after the transformers check

pytestmark = pytest.mark.slow  # HF's reference generate (torch fallbacks of the recurrent kernels) and two compiles a model

PROMPTS = [[2, 4, 8, 16, 32, 2, 4, 8, 16], [5, 9, 3, 17, 22, 40, 8, 1, 33, 12, 60, 5, 9], [3, 4, 3, 4, 3, 4, 3],
           [1, 2, 3, 1, 2, 3, 1, 2]]
NEW_TOKENS = 16
MAX_SEQS = 4
"""Repetitive prompts (prompt lookup drafts from them) and one of 13 tokens, over the 8-token chunk."""
PREEMPTING_BLOCKS = {1: 10, 2: 5, 4: 3}
"""Blocks of 4 per rank (by dcp) that hold the longest request with its drafts alone but not all four."""

F32 = 4  # model_bytes and the fp32 recurrent/SSM/kv state alike


def gated_delta_net(t: int, hk: int = 4, hv: int = 8, dk: int = 8, dv: int = 8, k: int = 4) -> int:
    return (k - 1) * (2 * (hk // t) * dk + (hv // t) * dv) * F32 + (hv // t) * dk * dv * F32


def short_conv(t: int, c: int = 32, k: int = 3) -> int:
    return (k - 1) * (c // t) * F32


def kimi_delta(t: int, h: int = 4, d: int = 8, k: int = 4) -> int:
    return (k - 1) * 3 * (h // t) * d * F32 + (h // t) * d * d * F32


def mamba2(t: int, h: int = 8, p: int = 8, g: int = 4, n: int = 8, k: int = 4) -> int:
    return (k - 1) * (h * p + 2 * g * n) // t * F32 + (h // t) * p * n * F32


def lightning(t: int, h: int = 4, d: int = 8) -> int:
    return (h // t) * d * d * F32


STATE_BYTES = {  # per request on one rank of tp = t: layers × the table's per-layer bytes
    "qwen3_5_text": lambda t: 3 * gated_delta_net(t), "qwen3_next": lambda t: 3 * gated_delta_net(t),
    "kimi_linear": lambda t: 3 * kimi_delta(t), "nemotron_h": lambda t: 1 * mamba2(t),
    "granitemoehybrid": lambda t: 2 * mamba2(t), "falcon_h1": lambda t: 2 * mamba2(t),
    "bamba": lambda t: 2 * mamba2(t), "minimax": lambda t: 2 * lightning(t), "lfm2": lambda t: 2 * short_conv(t),
}


@pytest.fixture(scope="module", params=sorted(ACCEPTANCE_MODELS))
def case(request):
    model = ACCEPTANCE_MODELS[request.param]()
    return request.param, dcpgraph.trace(model), [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def draft_program():
    return dcpgraph.trace(llama_draft())


def _run(engine, refs):
    for prompt in PROMPTS:
        engine.add_request(prompt, max_new_tokens=NEW_TOKENS)
    got = drain(engine)
    assert [got[i] for i in range(len(PROMPTS))] == refs
    assert engine.scheduler.stats["preemptions"] >= 1
    stats = engine.speculative_report()
    assert stats["drafted"] > stats["accepted"] and stats["state_replays"]["rows"] > 0, stats  # rolled back
    assert sorted(engine.scheduler.state_slots.free) == list(range(MAX_SEQS))
    return engine


def _check_state_bytes(engine, name: str, tp: int) -> None:
    report = engine.memory_report()
    assert report["recurrent_state_bytes_per_request"] == STATE_BYTES[name](tp)
    assert report["recurrent_state_snapshot_slots"] == report["recurrent_state_slots"] == MAX_SEQS
    assert report["recurrent_state_bytes_per_rank"] == [2 * MAX_SEQS * STATE_BYTES[name](tp)] * tp


def _speculative_config(method: str, draft_program) -> dict:
    if method == "ngram":
        return ngram()
    return {"method": "draft_model", "num_speculative_tokens": 2, "model": draft_program}


@pytest.mark.parametrize("method, tp, dcp", [("ngram", 1, 1), ("draft_model", 2, 2), ("ngram", 4, 4)],
                         ids=["ngram-tp1", "draft-tp2dcp2", "ngram-tp4dcp4"])
def test_speculation_through_chunks_and_a_preemption(case, draft_program, method, tp, dcp):
    """Each mesh with one speculation method; the state bytes of each tp."""
    name, program, refs = case
    engine = _run(dcpgraph.compile(program, tp=tp, dcp=dcp, block_size=4, max_num_batched_tokens=8,
                                   max_num_seqs=MAX_SEQS, max_model_len=64, num_blocks=PREEMPTING_BLOCKS[dcp],
                                   speculative_config=_speculative_config(method, draft_program)), refs)
    assert any(step.startswith("verify[") for step in engine.report()["graph_steps"])
    _check_state_bytes(engine, name, tp)
    assert STATE_BYTES[name](tp) * tp == STATE_BYTES[name](1)


SHARED = [5, 9, 3, 17, 22, 40, 8, 1, 33, 12, 60, 5, 9, 7, 7, 30, 2, 19]
PREFIX_PROMPTS = [SHARED + [44, 1], SHARED + [2, 3, 4], SHARED[:10] + [6], SHARED + [44, 1, 8]]
"""Prompts sharing an 18-token prefix (and the first one's whole prompt): the first alone, then the
other three at once in a cache too small for them (:data:`PREFIX_BLOCKS`, by dcp)."""
PREFIX_BLOCKS = {1: 12, 2: 6}


@pytest.fixture(scope="module")
def prefix_refs(case):
    name = case[0]
    model = ACCEPTANCE_MODELS[name]()
    return [hf_greedy(model, p, 8) for p in PREFIX_PROMPTS]


@pytest.mark.parametrize("tp, dcp, method", [(1, 1, None), (2, 2, "ngram")], ids=["tp1", "ngram-tp2dcp2"])
def test_prefix_caching_hits_restore_the_state(case, prefix_refs, tp, dcp, method):
    """Later requests hit the earlier ones' cached blocks and the recurrent state kept at the last
    of them (:mod:`dcpgraph.runtime.state_prefix_cache`), one of them through a preemption (its
    re-admission hits its own blocks): HF's tokens, with hits."""
    name, program, _ = case
    engine = dcpgraph.compile(program, tp=tp, dcp=dcp, block_size=4, max_num_batched_tokens=8, max_num_seqs=MAX_SEQS,
                              num_blocks=PREFIX_BLOCKS[dcp], enable_prefix_caching=True,
                              speculative_config=None if method is None else ngram())
    got = {0: engine.generate([PREFIX_PROMPTS[0]], 8)[0]}
    for prompt in PREFIX_PROMPTS[1:]:
        engine.add_request(prompt, max_new_tokens=8)
    got.update(drain(engine))
    assert [got[i] for i in range(len(PREFIX_PROMPTS))] == prefix_refs
    assert engine.scheduler.stats["preemptions"] >= 1
    assert engine.prefix_cache_report()["hit_requests"] >= 2
    assert engine.scheduler.state_prefix.stats["restored"] >= 2
    report = engine.memory_report()
    rows = MAX_SEQS * (2 if method else 1) + report["recurrent_state_prefix_rows"]
    assert report["recurrent_state_prefix_rows"] == MAX_SEQS
    assert report["recurrent_state_bytes_per_rank"] == [rows * STATE_BYTES[name](tp)] * tp


@pytest.mark.gloo
def test_every_hybrid_on_gloo_ranks_at_tp2_dcp2():
    """Two real gloo ranks, rank 0 driving, serving each model in turn through prefill chunks and a
    preemption, with prefix caching (a hit restores a kept state on both ranks): HF's greedy
    tokens, the same pools on both ranks, the state bytes of tp = 2."""
    from hybrid_models import GLOO_PREFIX_PROMPT, drive_models_on_gloo
    from hybrid_models import NEW_TOKENS as GLOO_TOKENS
    from hybrid_models import PROMPTS as GLOO_PROMPTS

    from dcpgraph.runtime.distributed import spawn

    names = sorted(ACCEPTANCE_MODELS)
    ranks = spawn(drive_models_on_gloo, 2, names, timeout_s=1200)
    for name in names:
        got = ranks[0][name]
        model = ACCEPTANCE_MODELS[name]()
        assert got["tokens"] == [hf_greedy(model, p, GLOO_TOKENS) for p in GLOO_PROMPTS], name
        assert got["prefix_tokens"] == hf_greedy(model, GLOO_PREFIX_PROMPT, GLOO_TOKENS), name
        assert got["state_prefix"]["restored"] >= 1, (name, got["state_prefix"])
        assert got["executor"] == "driver" and got["preemptions"] >= 1, name
        assert got["pools"] == ranks[1][name]["pools"], name
        assert got["memory"]["recurrent_state_bytes_per_request"] == STATE_BYTES[name](2), name
        assert got["memory"]["recurrent_state_bytes_per_rank"] == [(4 + 4) * STATE_BYTES[name](2)] * 2, name  # + prefix rows
