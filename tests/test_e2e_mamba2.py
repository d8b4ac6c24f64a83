"""End to end, Mamba-2 hybrids through ``dcpgraph.compile`` and the engine at tp=1·dcp=1: bamba,
nemotron_h (Mamba-2, attention, MLP, MoE), granitemoehybrid (MoE) and falcon_h1 (attention beside
the mixer) give HF's greedy tokens (``generate``, do_sample=False, eager experts) for a batch
whose longest prompt is longer than the prefill chunk (8 tokens), with a KV cache small enough to
preempt. ``memory_report`` counts the conv and SSM pools by the layout's formula. The
state-dropping features stay refused by name (TP and DCP meshes: ``test_mamba2_mesh``)."""

import pytest
import torch

import dcpgraph
from dcpgraph.recurrent_state import Mamba2Shape
from dcpgraph.testing.generation import hf_greedy

transformers = pytest.importorskip("transformers")

from hybrid_models import MAMBA2_MODELS, NEW_TOKENS, PROMPTS, run_through_preemption  # noqa: E402 - after the transformers check

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


def test_falcon_h1_buffers_computed_by_the_model_load_with_their_values(tmp_path):
    """Falcon-H1's µP vector is a buffer the checkpoint does not store, filled by the model's
    ``_init_weights`` (not its mixer's): the loader computes it as ``from_pretrained`` does."""
    from dcpgraph.checkpoints.loader import load_program
    from dcpgraph.program import STATE_KINDS

    model = MAMBA2_MODELS["falcon_h1"](ssm_multipliers=[0.5, 2.0, 1.5, 0.25, 3.0])
    model.save_pretrained(tmp_path)
    program = load_program(str(tmp_path), "float32")
    specs = [s for s in program.inputs if s.kind in STATE_KINDS]
    loaded = dict(zip((s.target for s in specs), program.local_state(0)))
    buffers = dict(model.named_buffers())
    mup = [name for name in loaded if name.endswith("mup_vector")]
    assert mup and all(torch.equal(loaded[name], buffers[name]) for name in mup)
    assert not torch.equal(buffers[mup[0]], torch.ones_like(buffers[mup[0]]))  # the multipliers given


@pytest.mark.slow  # a checkpoint written and served (~30 s)
def test_falcon_h1_from_a_checkpoint_gives_hf_greedy_tokens(tmp_path):
    from dcpgraph import LLM, SamplingParams
    from dcpgraph.testing.checkpoints import tiny_tokenizer

    model = MAMBA2_MODELS["falcon_h1"](ssm_multipliers=[0.5, 2.0, 1.5, 0.25, 3.0])
    model.save_pretrained(tmp_path)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
