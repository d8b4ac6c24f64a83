"""The engine's request lifecycle: outputs reach callers through events and finished requests are
not held; ``abort``; a prefill whose first token ends the request; ``continue_from`` through the
scheduler's limits; ``generate``/``prefill`` refuse to swallow other requests' tokens. On-demand
KV allocation: a cache smaller than all requests together serves them all with the tokens each
gets alone (greedy against HF, with speculation and prefix caching too; seeded sampling against
an engine that never preempts); requests larger than the cache and past ``max_waiting`` refused.

Model: ``build_model("llama")`` (fp64, 2 layers). References: HF ``generate`` on the same weights.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import dcpgraph
from dcpgraph.models import build_model
from dcpgraph.runtime.engine import Engine
from dcpgraph.runtime.executors import EmulatedExecutor
from dcpgraph.runtime.scheduler import QueueFullError
from dcpgraph.testing.generation import drain, hf_greedy

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [40, 41, 42, 43, 44]]
NEW = 6


@pytest.fixture(scope="module")
def setup():
    model = build_model("llama", dtype=torch.float64)
    return model, dcpgraph.trace(model), [hf_greedy(model, p, NEW) for p in PROMPTS]


def test_a_thousand_requests_leave_nothing_held(setup):
    """1,000 requests through add_request/step: every one's tokens arrive in events (equal to
    generate()'s), and afterwards no Request object is alive (weak references are dead)."""
    _, program, _ = setup
    engine = dcpgraph.compile(program, tp=1, block_size=4, max_num_seqs=64, max_num_batched_tokens=512,
                              max_model_len=32)
    prompts = [[(7 * i + k) % 250 + 3 for k in range(2 + i % 4)] for i in range(10)]
    expected = engine.generate(prompts, 2)
    refs, outputs, prompt_of = [], {}, {}
    for i in range(1000):
        rid = engine.add_request(prompts[i % 10], 2)
        prompt_of[rid] = i % 10
        refs.append(weakref.ref(engine.scheduler.get(rid)))
        if i % 100 == 99:  # interleave adding with stepping, as a server would
            for rid_, token, _ in engine.step():
                outputs.setdefault(rid_, []).append(token)
            assert engine.scheduler.live <= i + 1
    drain(engine, outputs, max_steps=1000)
    assert len(outputs) == 1000 and all(outputs[r] == expected[prompt_of[r]] for r in outputs)
    assert engine.scheduler.live == 0 and engine.blocks.free_blocks == engine.blocks.num_blocks
    gc.collect()
    assert [r for r in refs if r() is not None] == []


def test_prefill_whose_first_token_is_eos(setup):
    """The first sampled token is an EOS id: the request ends in step() (blocks released); the
    transfer says so, carries no KV, and continue_from refuses it cleanly."""
    model, _, refs = setup
    first = refs[0][0]
    model.generation_config.eos_token_id = first
    try:
        program = dcpgraph.trace(model)
    finally:
        model.generation_config.eos_token_id = 2
    assert hf_greedy_with_eos(model, PROMPTS[0], first) == [first]
    p_engine = dcpgraph.compile(program, tp=2, dcp=2, block_size=4)
    d_engine = dcpgraph.compile(program, tp=2, dcp=1, block_size=4)
    transfer = p_engine.prefill(PROMPTS[0])
    assert transfer.finished and transfer.tokens == tuple(PROMPTS[0] + [first])
    assert transfer.computed == 0 and transfer.caches == ()
    assert not p_engine.scheduler.has_work() and p_engine.blocks.free_blocks == p_engine.blocks.num_blocks
    with pytest.raises(dcpgraph.RequestError, match="already finished at its first token"):
        d_engine.continue_from(transfer, NEW)
    assert not d_engine.scheduler.has_work() and d_engine.blocks.free_blocks == d_engine.blocks.num_blocks
    # a prompt whose first token is not the EOS still goes across (and may end at EOS later)
    other = p_engine.prefill(PROMPTS[1])
    assert not other.finished
    rid = d_engine.continue_from(other, NEW)
    out = drain(d_engine)
    assert list(other.tokens[other.prompt_len:]) + out[rid] == hf_greedy_with_eos(model, PROMPTS[1], first, NEW)


def hf_greedy_with_eos(model, prompt, eos, n=NEW):
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=eos)
    return out[0, ids.shape[1]:].tolist()


def test_continue_from_goes_through_the_scheduler_limits(setup):
    _, program, refs = setup
    p_engine = dcpgraph.compile(program, tp=2, dcp=1, block_size=4)
    d_engine = dcpgraph.compile(program, tp=2, dcp=2, block_size=4, max_num_seqs=1)
    transfers = [p_engine.prefill(p) for p in PROMPTS[:2]]
    first = d_engine.continue_from(transfers[0], NEW)
    free = d_engine.blocks.free_blocks
    with pytest.raises(dcpgraph.RequestError, match="max_num_seqs=1"):
        d_engine.continue_from(transfers[1], NEW)
    assert d_engine.scheduler.live == 1 and d_engine.blocks.free_blocks == free
    with pytest.raises(dcpgraph.RequestError, match="at least 2"):
        d_engine.continue_from(transfers[1], 1)
    out = drain(d_engine)
    second = d_engine.continue_from(transfers[1], NEW)
    drain(d_engine, out)
    got = [list(t.tokens[t.prompt_len:]) + out[r] for t, r in zip(transfers, (first, second))]
    assert got == refs[:2]


def test_abort_frees_blocks_at_once_and_silences_the_request(setup):
    _, program, refs = setup
    engine = dcpgraph.compile(program, tp=2, dcp=2, block_size=4, max_num_seqs=2)
    ids = [engine.add_request(p, NEW) for p in PROMPTS]  # the third waits for a slot
    outputs: dict[int, list[int]] = {}
    for _ in range(2):
        for rid, token, _ in engine.step():
            outputs.setdefault(rid, []).append(token)
    held = engine.blocks.free_blocks
    assert engine.abort(ids[0]) is True
    assert engine.blocks.free_blocks > held and engine.scheduler.get(ids[0]) is None
    assert engine.abort(ids[2]) is True  # a waiting one: it never starts
    assert engine.abort(ids[0]) is False and engine.abort(12345) is False
    aborted_at = len(outputs[ids[0]])
    drain(engine, outputs)
    assert len(outputs[ids[0]]) == aborted_at and ids[2] not in outputs
    assert outputs[ids[1]] == refs[1]
    assert engine.blocks.free_blocks == engine.blocks.num_blocks and not engine.scheduler.has_work()


def test_generate_and_prefill_refuse_a_busy_engine(setup):
    _, program, refs = setup
    engine = dcpgraph.compile(program, tp=1, block_size=4)
    rid = engine.add_request(PROMPTS[0], NEW)
    with pytest.raises(dcpgraph.RequestError, match="needs an idle engine"):
        engine.generate(PROMPTS[1:], NEW)
    with pytest.raises(dcpgraph.RequestError, match="needs an idle engine"):
        engine.prefill(PROMPTS[1])
    assert drain(engine) == {rid: refs[0]}
    assert engine.generate(PROMPTS[1:], NEW) == refs[1:]


# -- on-demand KV allocation and preemption ---------------------------------------------------------
SMALL_CACHE = dict(tp=2, dcp=2, block_size=4, num_blocks=6, max_model_len=48, max_num_seqs=4)  # 48 tokens
LONG = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [40, 41, 42, 43, 44], [90, 17, 23, 61, 8, 12]]
LONG_NEW = 24  # 4 × 24 new tokens alone exceed the 48-token cache; each request (<= 31 tokens) fits


@pytest.mark.parametrize("features", [{}, dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}, enable_prefix_caching=True)],
                         ids=["plain", "speculative+prefix"])
def test_a_cache_smaller_than_the_requests_serves_them_all_unchanged(setup, features):
    """Greedy: HF's tokens for every request although the youngest keeps being preempted."""
    model, program, _ = setup
    refs = [hf_greedy(model, p, LONG_NEW) for p in LONG]
    assert min(len(r) for r in refs) == LONG_NEW  # no early EOS: the cache really runs out
    engine = dcpgraph.compile(program, **SMALL_CACHE, **features)
    assert engine.generate(LONG, LONG_NEW) == refs
    report = engine.report()["scheduler"]
    assert report["preemptions"] > 0 and report["preempted_tokens"] > 0 and report["peak_running"] >= 2
    assert engine.blocks.free_blocks == engine.blocks.num_blocks and report["kv_blocks_used"] == 0
    cache = engine.report()["prefix_cache"]
    if features.get("enable_prefix_caching"):  # every re-admission is looked up, counted apart
        assert cache["queries"] == len(LONG) and cache["query_tokens"] == sum(len(p) for p in LONG)
        assert cache["preempted_queries"] == report["preemptions"]
        assert cache["preempted_query_tokens"] > cache["preempted_hit_tokens"] > 0
    else:
        assert cache["queries"] == cache["preempted_queries"] == 0


def test_preempted_seeded_sampling_equals_running_alone(setup):
    _, program, _ = setup
    params = dict(temperature=0.9, top_k=40, seed=7)
    engine = dcpgraph.compile(program, **SMALL_CACHE)
    got = engine.generate(LONG, LONG_NEW, **params)
    assert engine.report()["scheduler"]["preemptions"] > 0
    alone = dcpgraph.compile(program, tp=2, dcp=2, block_size=4, max_model_len=48)
    # request i of a generate() call draws from seed + i: the same stream alone
    expected = [alone.generate([p], LONG_NEW, **{**params, "seed": 7 + i})[0] for i, p in enumerate(LONG)]
    assert got == expected
    assert alone.report()["scheduler"]["preemptions"] == 0


def test_requests_larger_than_the_cache_and_a_full_queue_are_refused(setup):
    model, program, _ = setup
    engine = dcpgraph.compile(program, **{**SMALL_CACHE, "num_blocks": 5})
    with pytest.raises(dcpgraph.RequestError, match="need 6 KV blocks; the cache has 5"):
        engine.add_request([1] * 20, 28)  # 48 tokens <= max_model_len, > 5 blocks of 8
    assert not engine.scheduler.has_work()
    bounded = Engine(engine.program, executor_cls=EmulatedExecutor, num_blocks=6, max_model_len=48,
                     max_batched_tokens=64, max_num_seqs=1, max_waiting=2)
    ids = [bounded.add_request(p, 4) for p in LONG[:2]]
    with pytest.raises(QueueFullError, match="max_waiting=2"):
        bounded.add_request(LONG[2], 4)
    assert issubclass(QueueFullError, dcpgraph.RequestError)
    assert sorted(drain(bounded)) == ids
    # generate() feeds its prompts as the bounded queue has room: twice as many as fit are served
    assert bounded.generate(LONG, 4) == [hf_greedy(model, p, 4) for p in LONG]
