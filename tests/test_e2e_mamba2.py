"""End to end, Mamba-2 hybrids through ``dcpgraph.compile`` and the engine at tp=1·dcp=1: bamba,
nemotron_h (Mamba-2, attention, MLP, MoE), granitemoehybrid (MoE) and falcon_h1 (attention beside
the mixer) give HF's greedy tokens (``generate``, do_sample=False, eager experts) for a batch
whose longest prompt is longer than the prefill chunk (8 tokens), with a KV cache small enough to
preempt. ``memory_report`` counts the conv and SSM pools by the layout's formula. The
state-dropping features stay refused by name (TP and DCP meshes: ``test_mamba2_mesh``)."""

import pytest
import torch

import dcpgraph
from dcpgraph.errors import UnsupportedModelError
from dcpgraph.recurrent_state import Mamba2Shape

transformers = pytest.importorskip("transformers")

from hybrid_models import MAMBA2_MODELS, run_through_preemption  # noqa: E402 - after the transformers check

# Mamba-2 layers per model; each 8 heads of 8, 2 groups of state 8, conv kernel 4, fp32.
MAMBA2_LAYERS = {"bamba": 2, "nemotron_h": 1, "granitemoehybrid": 2, "falcon_h1": 2}
LAYER_BYTES = Mamba2Shape(8, 8, 2, 8, 4).state_bytes_per_request(torch.float32)


@pytest.fixture(scope="module", params=list(MAMBA2_MODELS))
def case(request):
    model = MAMBA2_MODELS[request.param]()
    return request.param, model, dcpgraph.trace(model)


@pytest.mark.slow  # ~30-60 s a model on 2 shared cores (HF generate with its torch scan, compile, 20 steps)
def test_mamba2_hybrid_gives_hf_greedy_tokens_through_chunks_and_preemption(case):
    name, model, program = case
    engine = run_through_preemption(model, program)
    pools = {p.name: p for p in engine.program.recurrent_states}
    assert sorted(pools) == sorted([f"conv_state_{i}" for i in program.facts.extra["recurrent_layers"]]
                                   + [f"ssm_state_{i}" for i in program.facts.extra["recurrent_layers"]])
    report = engine.memory_report()
    assert report["recurrent_state_bytes_per_request"] == MAMBA2_LAYERS[name] * LAYER_BYTES
    allocated = sum(t.numel() * t.element_size() for key, t in engine.executor.caches[0].items() if key in pools)
    assert report["recurrent_state_bytes_per_rank"] == [allocated]


@pytest.mark.slow  # a verified compile per option and model
@pytest.mark.parametrize("options, message", [
    (dict(enable_prefix_caching=True), "enable_prefix_caching is not supported with recurrent layers"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative decoding is not supported with recurrent layers"),
])
def test_mamba2_features_without_exact_state_are_refused_by_name(case, options, message):
    _, _, program = case
    with pytest.raises(UnsupportedModelError, match=message):
        dcpgraph.compile(program, block_size=4, **options)
