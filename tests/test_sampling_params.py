"""One ``SamplingParams`` (vLLM's names and defaults) for the offline API, the server and the engine.

The class is the same object wherever users import it; the engine's keyword API stays greedy by
default while the class keeps vLLM's ``temperature=1.0``; ``params=SamplingParams(...)`` gives
the engine the same request as its keywords; a keyword the engine does not sample with is refused.

Model (engine tests): ``build_model("llama")`` (fp64, 2 layers) on one rank.
"""

from __future__ import annotations

import pytest
import torch

import dcpgraph
from dcpgraph.models import build_model
from dcpgraph.runtime.rejection import probabilities
from dcpgraph.runtime.sampling import sample
from dcpgraph.runtime.sampling_params import ENGINE_FIELDS, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4]]


def test_one_class_wherever_it_is_imported():
    import dcpgraph.runtime.sampling
    import dcpgraph.serving
    import dcpgraph.serving.params

    assert (dcpgraph.SamplingParams is dcpgraph.serving.SamplingParams is dcpgraph.serving.params.SamplingParams
            is dcpgraph.runtime.sampling.SamplingParams is SamplingParams)


def test_class_defaults_are_vllms_engine_keywords_are_greedy():
    assert not SamplingParams().greedy and SamplingParams().temperature == 1.0
    engine = SamplingParams.for_engine()
    assert engine.greedy and engine.temperature == 0.0
    assert SamplingParams.for_engine(temperature=0.7, seed=3) == SamplingParams(temperature=0.7, seed=3)
    sp = SamplingParams(temperature=0.5, top_k=-1, seed=4)
    assert SamplingParams.for_engine(params=sp) is sp
    # engine_params round-trips through the engine's keywords (what RemoteEngine sends to ranks)
    again = SamplingParams.for_engine(**sp.engine_params())
    assert all(getattr(again, f) == getattr(sp, f) for f in ENGINE_FIELDS if f != "top_k") and again.top_k == 0


def test_greedy_threshold_is_vllms():
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-4).greedy
    assert SamplingParams(temperature=1e-6).engine_params() == {}


def test_engine_refuses_keywords_it_does_not_sample_with_and_mixed_forms():
    with pytest.raises(TypeError, match=r"unexpected sampling keyword\(s\) \['stop'\]"):
        SamplingParams.for_engine(stop="x")
    with pytest.raises(TypeError, match="not both"):
        SamplingParams.for_engine(SamplingParams(), temperature=0.5)
    with pytest.raises(TypeError, match="must be a SamplingParams"):
        SamplingParams.for_engine({"temperature": 0.5})
    with pytest.raises(ValueError, match="params.n must be 1"):
        SamplingParams.for_engine(SamplingParams(n=2))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams.for_engine(temperature=-1)


def test_top_k_minus_one_is_off_in_sampling_and_verification():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    off, minus = SamplingParams(temperature=0.8, top_k=0), SamplingParams(temperature=0.8, top_k=-1)
    draws = [[sample(logits, p, torch.Generator().manual_seed(s)) for s in range(5)] for p in (off, minus)]
    assert draws[0] == draws[1]
    assert torch.equal(probabilities(logits, off), probabilities(logits, minus))


@pytest.fixture(scope="module")
def program():
    return dcpgraph.trace(build_model("llama", dtype=torch.float64))


def test_engine_takes_params_or_keywords_for_the_same_tokens(program):
    engine = dcpgraph.compile(program, tp=1, block_size=4, max_model_len=32)
    greedy = engine.generate(PROMPTS, 5)
    assert engine.generate(PROMPTS, 5, params=SamplingParams(temperature=0)) == greedy
    keywords = dict(temperature=0.9, top_k=40, seed=7)
    sampled = engine.generate(PROMPTS, 5, **keywords)
    assert engine.generate(PROMPTS, 5, params=SamplingParams(**keywords)) == sampled
    rid = engine.add_request(PROMPTS[1], 5, params=SamplingParams(**keywords))
    out = []
    while engine.scheduler.has_work():
        out += [t for r, t, _ in engine.step() if r == rid]
    assert out == engine.generate([PROMPTS[1]], 5, **keywords)[0]  # one prompt: seed + 0, as add_request


def test_logits_shaping_requests_take_no_drafts_and_ids_are_checked_against_the_vocabulary(program):
    """Drafts are verified against raw logits, so a request whose greedy token may differ from the
    raw argmax must not get any; ``min_p`` alone never changes a greedy token, so it may."""
    engine = dcpgraph.compile(program, tp=1, block_size=4, max_model_len=32,
                              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    shaped = [dict(logit_bias={3: 1.0}), dict(allowed_token_ids=[3, 4]), dict(bad_words_token_ids=[[3]]),
              dict(min_tokens=2), dict(repetition_penalty=1.2)]
    for sampling in shaped:
        rid = engine.add_request(PROMPTS[0], 4, **sampling)
        assert engine.scheduler.get(rid).speculative is False, sampling
    rid = engine.add_request(PROMPTS[0], 4, min_p=0.5, ignore_eos=True)
    assert engine.scheduler.get(rid).speculative is True
    with pytest.raises(dcpgraph.RequestError, match="logit_bias holds token ids"):
        engine.add_request(PROMPTS[0], 4, logit_bias={program.facts.vocab_size: 1.0})


def test_reset_prefix_cache_frees_cached_blocks_and_forgets_every_hash():
    from dcpgraph.runtime.blocks import BlockManager

    blocks = BlockManager(8, 2, enable_prefix_caching=True)
    blocks.allocate(0, 6)
    blocks.register(0, [1, 2, 3, 4, 5, 6], 6)
    blocks.allocate(1, 4, blocks.match_prefix([1, 2, 3, 4, 9]))
    blocks.release(0)  # its last block is cached free, the first two are shared with request 1
    assert blocks.reset_prefix_cache() == 1 and blocks.match_prefix([1, 2, 3, 4, 5, 6, 7]) == []
    blocks.register(1, [1, 2, 3, 4], 4)  # a live request registers nothing after a reset
    blocks.release(1)
    assert blocks.free_blocks == 8 and blocks.cached_blocks == 0
