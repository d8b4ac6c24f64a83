"""The scheduler on its own: a ``BlockManager`` and hand-made step results, no model.

Covered: the chunked-prefill token budget and when a chunk samples; decode rows before prefill
chunks; admission limits (``max_num_seqs``, free blocks); on-demand allocation preempting the
youngest request, which recomputes its output later, and the whole-request policy that never does;
the bounded waiting queue; a prefix hit starting a request after its shared blocks; ``postprocess`` (stop at ``max_new_tokens`` or EOS, speculative acceptance and
what it leaves cached); finishing and aborting release blocks at once and drop the request;
``adopt`` obeys ``max_num_seqs``.
"""

from __future__ import annotations

import pytest

from dcpgraph.errors import RequestError
from dcpgraph.runtime.blocks import BlockManager
from dcpgraph.runtime.sampling import SamplingParams
from dcpgraph.runtime.scheduler import QueueFullError, Request, RowOutput, Scheduler, StepEvent

EOS = 2


def make(num_blocks=16, tokens_per_block=4, budget=8, seqs=4, prefix=False, spec=0):
    blocks = BlockManager(num_blocks, tokens_per_block, prefix)
    return Scheduler(blocks, budget, seqs, eos_token_ids=(EOS,), speculative_tokens=spec)


def request(rid, prompt_len, new=4, first=10):
    return Request(rid, list(range(first, first + prompt_len)), new, SamplingParams(temperature=0))


def outputs_for(plan, token=7):
    """A token for every chunk that samples, nothing for the others."""
    return [RowOutput([token] if item.samples else [], []) for item in plan]


def shape(plan):
    return [(item.request.id, item.chunk.start, len(item.chunk.tokens), item.samples) for item in plan]


def test_chunks_share_the_token_budget_and_sample_at_the_last_known_token():
    s = make(budget=8)
    s.add(request(0, 10))
    s.add(request(1, 5))
    plan = s.schedule()
    assert shape(plan) == [(0, 0, 8, False)]  # the budget is spent: request 1 is not admitted yet
    assert s.postprocess(plan, outputs_for(plan)) == []
    plan = s.schedule()
    assert shape(plan) == [(0, 8, 2, True), (1, 0, 5, True)]  # 2 + 5 <= 8
    events = s.postprocess(plan, outputs_for(plan))
    assert events == [StepEvent(0, 7, False), StepEvent(1, 7, False)]
    assert [s.get(i).computed for i in (0, 1)] == [10, 5] and s.prompt_tokens_computed == 15


def test_decode_rows_come_first_then_prefill_chunks_in_admission_order():
    s = make(budget=6)
    s.add(request(0, 12))  # admitted first, prefills over several steps
    plan = s.schedule()
    assert shape(plan) == [(0, 0, 6, False)]
    s.postprocess(plan, outputs_for(plan))
    younger = request(1, 4)
    younger.output, younger.computed = [3], 4  # decoding: one pending token
    s.adopt(younger)
    s.add(request(2, 3))
    plan = s.schedule()  # the younger decode row first, then 0's chunk in what is left of the budget
    assert shape(plan) == [(1, 4, 1, True), (0, 6, 5, False)]
    s.postprocess(plan, outputs_for(plan))
    plan = s.schedule()  # one pending token is a decode row, in admission order; the newcomer after
    assert shape(plan) == [(0, 11, 1, True), (1, 5, 1, True), (2, 0, 3, True)]
    s.postprocess(plan, outputs_for(plan))
    plan = s.schedule()  # all decoding: admission order
    assert shape(plan) == [(0, 12, 1, True), (1, 6, 1, True), (2, 3, 1, True)]


def test_admission_respects_max_num_seqs_and_free_blocks():
    s = make(num_blocks=4, tokens_per_block=4, budget=64, seqs=2)
    for rid in range(3):
        s.add(request(rid, 4, new=4))
    plan = s.schedule()
    assert [i.request.id for i in plan] == [0, 1] and len(s.waiting) == 1  # the sequence slots
    assert s.blocks.free_blocks == 2  # on demand: one block each, for the 4 prompt tokens
    s.abort(0)
    s.max_num_seqs = 3
    plan = s.schedule()
    assert [i.request.id for i in plan] == [1, 2]
    s2 = make(num_blocks=2, tokens_per_block=4, budget=64, seqs=4)
    s2.add(request(0, 8, new=1))
    s2.add(request(1, 4, new=1))
    assert [i.request.id for i in s2.schedule()] == [0]  # 1's first chunk needs a block; none is free
    assert list(s2.waiting) == [s2.get(1)]


def test_the_youngest_request_is_preempted_and_recomputes_its_output():
    """4 blocks of 4 tokens; two requests of 4 + 8 tokens (3 blocks each) start together. When
    the older one needs its third block, the younger is preempted (blocks released, output kept);
    re-admitted after, it recomputes prompt + output in one chunk and samples from its end."""
    s = make(num_blocks=4, tokens_per_block=4, budget=64, seqs=4)
    old, young = request(0, 4, new=8), request(1, 4, new=8, first=50)
    s.add(old)
    s.add(young)
    for step in range(5):  # prefill, then decodes up to 8 cached tokens each: 4 blocks in use
        plan = s.schedule()
        assert [i.request.id for i in plan] == [0, 1]
        s.postprocess(plan, [RowOutput([10 + step], []), RowOutput([20 + step], [])])
    assert (old.computed, young.computed, s.blocks.free_blocks) == (8, 8, 0)
    plan = s.schedule()  # old's 9th token needs a third block: young goes
    assert shape(plan) == [(0, 8, 1, True)]
    assert list(s.waiting) == [young] and young.computed == 0 and not s.blocks.holds(1)
    assert young.output == [20, 21, 22, 23, 24] and s.stats["preemptions"] == 1
    assert s.stats["preempted_tokens"] == 8 and s.blocks.free_blocks == 1
    s.postprocess(plan, [RowOutput([15], [])])
    while s.get(0) is not None:  # no room to re-admit young until old finishes
        plan = s.schedule()
        assert [i.request.id for i in plan] == [0]
        s.postprocess(plan, [RowOutput([16], [])])
    plan = s.schedule()
    assert shape(plan) == [(1, 0, 9, True)]  # prompt + its 5 tokens, sampled at the end
    s.postprocess(plan, [RowOutput([25], [])])
    assert young.output == [20, 21, 22, 23, 24, 25] and young.computed == 9
    assert s.stats["peak_running"] == 2


def test_whole_request_allocation_never_preempts():
    s = make(num_blocks=4, tokens_per_block=4, budget=64, seqs=4)
    s.whole_request = True
    s.add(request(0, 4, new=8))
    s.add(request(1, 4, new=8))
    plan = s.schedule()
    assert [i.request.id for i in plan] == [0] and s.blocks.free_blocks == 1  # 3 blocks reserved
    while s.has_work():
        plan = s.schedule()
        s.postprocess(plan, outputs_for(plan))
    assert s.stats["preemptions"] == 0 and s.stats["peak_running"] == 1


def test_the_waiting_queue_is_bounded():
    s = make(seqs=1)
    s.max_waiting = 2
    s.add(request(0, 4))
    s.add(request(1, 4))
    with pytest.raises(QueueFullError, match="max_waiting=2"):
        s.add(request(2, 4))
    assert s.live == 2 and not s.can_add()
    s.schedule()  # 0 is admitted: room for one more
    assert s.can_add()
    s.add(request(2, 4))


def test_a_prefix_hit_starts_after_the_shared_blocks():
    s = make(tokens_per_block=4, budget=64, prefix=True)
    s.add(request(0, 10, new=1))
    plan = s.schedule()
    table0 = list(plan[0].chunk.block_table)
    assert s.postprocess(plan, outputs_for(plan)) == [StepEvent(0, 7, True)]  # max_new_tokens=1
    assert s.blocks.cached_blocks == 2 and not s.has_work()
    s.add(request(1, 11, new=1))  # same first 10 tokens: 2 full blocks hit
    plan = s.schedule()
    assert shape(plan) == [(1, 8, 3, True)]
    assert list(plan[0].chunk.block_table[:2]) == table0[:2] and s.blocks.shared_blocks(1) == 2
    s.postprocess(plan, outputs_for(plan))
    assert s.prompt_tokens_computed == 10 + 3
    assert s.blocks.stats["hit_tokens"] == 8


def test_stop_conditions_finish_release_and_drop():
    s = make(budget=64)
    s.add(request(0, 3, new=3))
    s.add(request(1, 3, new=3))
    free = s.blocks.free_blocks
    plan = s.schedule()
    s.postprocess(plan, [RowOutput([5], []), RowOutput([EOS], [])])  # 1 ends at EOS
    assert s.get(1) is None and [r.id for r in s.running] == [0]
    assert s.blocks.free_blocks == free - 1  # only 0's block (its 3 prompt tokens) is held
    for token in (5, 5):
        plan = s.schedule()
        events = s.postprocess(plan, [RowOutput([token], [])])
    assert events == [StepEvent(0, 5, True)]  # the third token reaches max_new_tokens
    assert not s.has_work() and s.blocks.free_blocks == free and s.live == 0


def test_abort_releases_blocks_now_and_is_a_no_op_for_unknown_ids():
    s = make(budget=64, seqs=1)
    running, waiting = request(0, 5), request(1, 5)
    s.add(running)
    s.add(waiting)
    s.postprocess(plan := s.schedule(), outputs_for(plan))
    free = s.blocks.free_blocks
    assert s.abort(1) and list(s.waiting) == [] and s.blocks.free_blocks == free  # held no blocks
    assert s.abort(0) and s.blocks.free_blocks == s.blocks.num_blocks and not s.has_work()
    assert running.finished and waiting.finished
    assert not s.abort(0) and not s.abort(99)
    assert s.schedule() == []


def test_speculative_acceptance_bookkeeping():
    s = make(budget=64, spec=3)
    s.add(request(0, 4, new=10))
    s.postprocess(plan := s.schedule(), outputs_for(plan))  # prefill: 4 tokens, no drafts
    assert plan[0].draft_room == 0
    plan = s.schedule()
    assert plan[0].draft_room == 3 and len(plan[0].chunk.tokens) == 1
    # drafts [5, 6, 8]; the target's greedy tokens confirm 5, 6 and then say 9
    events = s.postprocess(plan, [RowOutput([5, 6, 9, 1], [5, 6, 8])])
    assert [e.token for e in events] == [5, 6, 9]
    req = s.get(0)
    assert req.output == [7, 5, 6, 9] and req.computed == 4 + 1 + 2  # last token + 2 confirmed drafts
    assert s.spec_stats == {"drafted": 3, "accepted": 2}
    # room never runs past max_new_tokens: 6 tokens left to emit, so at most 5 drafts, here 3
    req.max_new_tokens = 6
    plan = s.schedule()
    assert plan[0].draft_room == 1
    events = s.postprocess(plan, [RowOutput([4, 3], [4])])
    assert [e.token for e in events] == [4, 3] and events[-1].finished
    assert not s.has_work() and s.blocks.free_blocks == s.blocks.num_blocks


def test_a_draft_past_a_stop_is_not_kept():
    s = make(budget=64, spec=3)
    s.add(request(0, 4, new=10))
    s.postprocess(plan := s.schedule(), outputs_for(plan))
    plan = s.schedule()
    events = s.postprocess(plan, [RowOutput([5, EOS, 6, 1], [5, EOS, 6])])
    assert [(e.token, e.finished) for e in events] == [(5, False), (EOS, True)]
    assert not s.has_work()


def test_adopt_obeys_max_num_seqs_and_free_blocks():
    s = make(num_blocks=4, budget=64, seqs=1)
    a = request(0, 4, new=4)
    a.output, a.computed = [3], 4  # 4 tokens already cached elsewhere
    s.adopt(a)
    assert s.running == [a] and s.blocks.free_blocks == 2  # blocks for its 5 known tokens
    with pytest.raises(RequestError, match="max_num_seqs=1"):
        s.adopt(request(1, 4))
    assert s.live == 1
    s.max_num_seqs = 2
    with pytest.raises(RequestError, match="not enough free KV blocks"):
        s.adopt(request(2, 12, new=4))  # 3 blocks; 2 are free
    assert s.live == 1 and s.blocks.free_blocks == 2
    plan = s.schedule()
    assert shape(plan) == [(0, 4, 1, True)]  # it continues from its cached tokens


def test_prefix_cache_counts_every_admission_and_re_admissions_apart():
    """vLLM's meaning: queries and hits in tokens, at every admission. The scene of the
    preemption test with prefix caching on: young's 2 full blocks are registered when it is
    preempted; old's growth evicts the deeper one (released tail first), so young's re-admission
    (4 prompt + 5 output tokens) hits its first block only, and is counted as a preempted query."""
    s = make(num_blocks=4, tokens_per_block=4, budget=64, seqs=4, prefix=True)
    old, young = request(0, 4, new=8), request(1, 4, new=8, first=50)
    s.add(old)
    s.add(young)
    for step in range(5):
        plan = s.schedule()
        s.postprocess(plan, [RowOutput([10 + step], []), RowOutput([20 + step], [])])
    while s.get(0) is not None:
        plan = s.schedule()
        s.postprocess(plan, [RowOutput([16], []) if i.request is old else RowOutput([], []) for i in plan])
    assert s.stats["preemptions"] == 1
    plan = s.schedule()
    assert shape(plan) == [(1, 4, 5, True)]  # its first block came from the cache
    stats = s.blocks.stats
    assert (stats["queries"], stats["query_tokens"], stats["hit_tokens"]) == (2, 8, 0)
    assert (stats["preempted_queries"], stats["preempted_query_tokens"], stats["preempted_hit_tokens"]) == (1, 9, 4)


def test_metrics_expose_the_prefix_cache_counters_in_tokens():
    from dcpgraph.serving.metrics import Metrics

    cache = {"query_tokens": 30, "hit_tokens": 16, "preempted_query_tokens": 9, "preempted_hit_tokens": 4}
    from dcpgraph.testing.prometheus import samples

    text = Metrics("m").render({"running": 0, "waiting": 0, "kv_usage": [0.0], "prefix_cache": cache})
    for name, value in [("vllm:prefix_cache_queries_total", 30), ("vllm:prefix_cache_hits_total", 16),
                        ("dcpgraph:prefix_cache_preempted_queries_total", 9),
                        ("dcpgraph:prefix_cache_preempted_hits_total", 4)]:
        assert samples(text, name, model_name="m") == [value], name
