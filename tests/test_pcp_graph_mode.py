"""Graph-mode decode and verification buckets with ``pcp > 1``: a padded bucket's PCP rows are
split anew, so every step of one bucket has the same input shapes on every rank (what a backend
captures once), and the greedy tokens equal HF ``generate`` on the same weights; draft-model
speculation with ``pcp > 1`` (its verification steps in those buckets)."""

from __future__ import annotations

import pytest
from pcp_models import pcp_model

import dcpgraph
from dcpgraph.testing.generation import hf_greedy

PROMPTS = [[5, 9, 4, 77, 30, 31, 5, 9, 4, 77, 30, 31, 12], [17], [40, 41, 42, 43, 44, 45, 46]]
NEW = 8


def _record_shapes(engine) -> dict:
    """Wrap the executor: per step key, the set of (shared, per-rank) input shapes it ran with."""
    seen: dict = {}
    run = engine.executor.run

    def recording(shared, per_rank, key="mixed"):
        shapes = (tuple(sorted((k, tuple(v.shape)) for k, v in shared.items())),
                  tuple(tuple(sorted((k, tuple(v.shape)) for k, v in own.items())) for own in per_rank))
        seen.setdefault(key if key == "mixed" else tuple(key), set()).add(shapes)
        return run(shared, per_rank, key)

    engine.executor.run = recording
    return seen


def _check(engine, model, prefix: str) -> dict:
    seen = _record_shapes(engine)
    assert engine.generate(PROMPTS, NEW) == [hf_greedy(model, p, NEW) for p in PROMPTS]
    report = engine.report()
    assert report["decode_buckets"] == [1, 2, 4]
    used = [k for k in seen if k != "mixed" and k[0] == prefix]
    assert used and any(name.startswith(f"{prefix}[") for name in report["graph_steps"])
    for key in used:  # a bucket is one static shape: the same inputs' shapes at every step, every rank
        assert len(seen[key]) == 1, (key, seen[key])
        (_, ranks), = seen[key]
        assert len(set(ranks)) == 1  # every PCP rank exchanges the same shapes
    return report


def test_pcp_decode_buckets_are_static_and_exact_at_1_2_2():
    model = pcp_model("qwen3")
    engine = dcpgraph.compile(model, tp=1, pcp=2, dcp=2, capture_limit=4, block_size=4, max_num_batched_tokens=8,
                              backend="eager")
    _check(engine, model, "decode")  # 3 decode rows padded to bucket 4 with the PCP rows split anew


@pytest.mark.slow  # an emulated (1,2,2) target and its draft: ~28 s on 2 loaded cores
def test_pcp_draft_model_speculation_with_verify_buckets_is_exact_and_accepts_its_own_drafts():
    """A draft equal to the target, compiled on the same (1,2,2) mesh (its own steps split over the
    PCP ranks too), must have every draft accepted: its KV stays in step with the accepted tokens."""
    model = pcp_model("qwen3")
    engine = dcpgraph.compile(model, tp=1, pcp=2, dcp=2, capture_limit=4, block_size=4, max_num_batched_tokens=8,
                              backend="eager", speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                                                   "model": model})
    stats = _check(engine, model, "verify")["speculative"]
    assert stats["drafted"] > 0 and stats["accepted"] == stats["drafted"], stats
