"""Speculative decoding: prompt-lookup drafts verified as one multi-token query, under DCP too."""

from __future__ import annotations

import pytest
import torch

import dcpgraph
from dcpgraph.models import build_model
from dcpgraph.runtime.rejection import accept
from dcpgraph.speculative.ngram import propose
from dcpgraph.testing.generation import hf_greedy

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [3], [40, 41, 42, 40, 41]]
NEW = 20


def test_propose_follows_the_latest_ngram_match():
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # latest match of [1, 2, 3]
    assert propose([4, 5, 6, 4], 3) == [5, 6, 4]  # falls back to the 1-gram [4]
    assert propose([4, 5, 6, 4], 3, min_ngram=2) == []  # prompt_lookup_min=2: no 1-gram fallback
    assert propose([5, 3, 8, 1, 3, 9, 5, 3], 2) == [8, 1]  # the 2-gram [5, 3] first
    assert propose([5, 3, 8, 1, 3, 9, 5, 3], 2, max_ngram=1) == [9, 5]  # prompt_lookup_max=1: latest [3]
    assert propose([1, 2, 3], 4) == []
    assert propose([1, 1, 1], 0) == []


def test_accept_counts_the_confirmed_prefix():
    assert accept([7, 8, 9], [7, 8, 5, 1]) == 2
    assert accept([7, 8], [6, 8, 9]) == 0
    assert accept([7, 8], [7, 8, 9]) == 2


@pytest.fixture(scope="module", params=["llama", "deepseek_v2"])
def setup(request):
    model = build_model(request.param, dtype=torch.float64)
    refs = [hf_greedy(model, p, NEW) for p in PROMPTS]
    return request.param, dcpgraph.trace(model), refs


@pytest.mark.parametrize("tp, dcp, interleave", [(1, 1, 1), (2, 2, 1), (4, 2, 4)])
def test_speculative_tokens_equal_plain_greedy(setup, tp, dcp, interleave):
    arch, program, refs = setup
    engine = dcpgraph.compile(program, tp=tp, dcp=dcp, interleave=interleave, block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert engine.generate(PROMPTS, NEW) == refs
    stats = engine.report()["speculative"]
    assert stats["drafted"] > 0
    if arch == "llama":  # this model falls into loops that prompt lookup predicts
        assert stats["accepted"] > 0
        assert engine.steps < NEW  # accepted drafts save steps


def test_speculation_with_prefix_caching_and_sampling(setup):
    _, program, refs = setup
    engine = dcpgraph.compile(program, tp=2, dcp=2, block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, enable_prefix_caching=True)
    assert engine.generate(PROMPTS, NEW) == refs
    assert engine.generate(PROMPTS, NEW) == refs  # second round hits the cache
    before = engine.report()["speculative"]["drafted"]
    sampled = engine.generate(PROMPTS, NEW, temperature=0.3, seed=1)
    assert engine.report()["speculative"]["drafted"] > before  # sampled requests draft (rejection sampling)
    assert engine.generate(PROMPTS, NEW, temperature=0.3, seed=1) == sampled  # and their seeds reproduce


def test_speculative_config_ngram_equals_speculative_tokens(setup):
    """The vLLM-shaped config with the old defaults is the old option; with decode buckets on
    (the default) verification steps run in their static-shape (R_b, 1 + k) graph."""
    _, program, refs = setup
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    engine = dcpgraph.compile(program, block_size=4, speculative_config=config)
    assert engine.generate(PROMPTS, NEW) == refs
    report = engine.report()
    assert report["speculative"]["method"] == "ngram" and report["speculative"]["prompt_lookup_min"] == 1
    assert report["graph_steps"].get("verify[4x4]", 0) > 0
    lookup = dcpgraph.compile(program, block_size=4, capture_limit=0,
                              speculative_config={**config, "prompt_lookup_min": 2})
    assert lookup.generate(PROMPTS, NEW) == refs
    assert set(lookup.report()["graph_steps"]) == {"mixed"}
