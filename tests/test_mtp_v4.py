"""MTP speculation (``method="mtp"``) for DeepSeek-V4: the checkpoint's ``mtp.0.*`` layer
(:mod:`dcpgraph.speculative.mtp_v4_module`) drafts from the target's hyper-connection streams.

References, both independent of the compiled MTP: HF ``generate``'s greedy tokens on the target
weights (speculation must not change a token), and a dense forward of the MTP layer written in
``tests/dsv4_mtp.py`` (HF's decoder block with an explicit sliding-window mask over the whole
context, the rest of DeepSeek's ``MTPBlock`` by hand, no cache) fed the HF target's streams:
every draft the compiled proposer makes must equal that loop's argmax. The checkpoint is nearly
a bigram model (``dsv4_mtp.save_checkpoint(eps=...)``), so drafts are both kept and rejected.
"""

from __future__ import annotations

import dsv4_mtp
import pytest
import torch
from mtp_reference import record_drafts

import dcpgraph
from dcpgraph.checkpoints.loader import load_program
from dcpgraph.testing.generation import hf_greedy

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [3], [40, 41, 42, 40, 41, 9, 8, 7, 6, 5, 4]]
NEW = 10
K = 2
SPEC = {"method": "mtp", "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import transformers as tf

    path = str(tmp_path_factory.mktemp("v4mtp"))
    ref = dsv4_mtp.save_checkpoint(path, eps=0.005, hidden_part=0.1, mtp_attention=0.05)
    target = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    target.generation_config.eos_token_id = target.config.eos_token_id  # both stop at EOS, as the engine does
    want = [hf_greedy(target, p, NEW) for p in PROMPTS]
    return path, ref, target, want


def check_drafts(engine, target, ref, seen) -> None:
    """Drafts kept and rejected (a chained one kept too); every recorded draft the dense loop's argmax."""
    stats = engine.report()["speculative"]
    assert stats["method"] == "mtp" and 0 < stats["accepted"] < stats["drafted"], stats
    assert stats["accepted_per_position"][1] > 0, stats
    assert len(seen) >= 10
    for tokens, s, drafts in seen:
        dense = dsv4_mtp.dense_drafts(target, ref, tokens, s, drafts)
        assert drafts == dense.argmax(-1).tolist(), (tokens[: s + 1], drafts)


@pytest.mark.slow  # the V4 target's and the MTP layer's traces: ~20 s, up to 45 s on 2 loaded cores
def test_v4_mtp_through_llm_gives_hf_greedy_tokens(checkpoint):
    """``LLM(model=dir, speculative_config={"method": "mtp", ...})`` at tp1. Greedy: HF's tokens,
    each draft the dense loop's argmax. Sampled (temperature 1): each draft's proposal
    distribution is the dense loop's softmax, fed the same drafts (a check of the MTP's logits,
    not only their argmax)."""
    from dcpgraph import LLM, SamplingParams

    path, ref, target, want = checkpoint
    llm = LLM(model=path, dtype="float64", block_size=4, max_num_batched_tokens=8, speculative_config=SPEC)
    seen = record_drafts(llm.engine)
    greedy = SamplingParams(temperature=0, max_tokens=NEW)
    got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)
    assert [list(o.outputs[0].token_ids) for o in got] == want
    check_drafts(llm.engine, target, ref, seen)

    proposer, sampled = llm.engine.runner.proposer, []
    propose = proposer.propose
    proposer.propose = lambda plan: [sampled.append((list(item.request.tokens), item.chunk.start, d)) or d
                                     for item, d in zip(plan, propose(plan))]
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:]], SamplingParams(temperature=1.0, seed=3, max_tokens=6))
    sampled = [(tokens, s, d) for tokens, s, d in sampled if d.tokens]
    assert len(sampled) >= 4
    for tokens, s, d in sampled:
        dense = dsv4_mtp.dense_drafts(target, ref, tokens, s, d.tokens)
        torch.testing.assert_close(d.probs, torch.softmax(dense, -1), rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # the V4 target's and the MTP layer's traces: ~20 s, up to 70 s on 2 loaded cores
def test_v4_mtp_at_tp2_dcp2_gives_hf_greedy_tokens_and_drafts_equal_a_dense_loop(checkpoint):
    """HF's greedy tokens with the MTP layer's attention sharded by DCP; each draft the dense
    loop's argmax, the MTP's one-token steps in decode buckets. Too few blocks for the three
    requests preempt one, and the tables then name the highest block (the V4 engine's scratch
    block 0 comes on top of ``num_blocks``, and the MTP's cache holds it too)."""
    path, ref, target, want = checkpoint
    engine = dcpgraph.compile(load_program(path, "float64"), tp=2, dcp=2, block_size=4, max_num_batched_tokens=8,
                              num_blocks=4, speculative_config=SPEC)
    seen = record_drafts(engine)
    assert engine.generate(PROMPTS, NEW) == want
    assert engine.report()["scheduler"]["preemptions"] > 0
    assert any(n.startswith("verify[") for n in engine.report()["graph_steps"])
    assert any(n.startswith("decode[") for n in engine.runner.proposer.graph_steps)
    check_drafts(engine, target, ref, seen)


def test_every_v4_mtp_tensor_is_found_under_the_released_names_with_its_values(tmp_path):
    """transformers' own ``save_pretrained`` wrote the MTP block under the released names
    (``attn.wq_a``, ``ffn.experts.{e}.w1``, ``hc_attn_fn``, ...) and the test moved it to
    ``mtp.0.``; the loader's forward renaming (and expert merge) finds every parameter and buffer
    of the MTP module with the values of HF's in-memory block, the MTP's own tensors, and the
    target's embedding and head."""
    from dcpgraph.checkpoints.tensor_sources import read_local
    from dcpgraph.program import REPLICATE
    from dcpgraph.speculative.mtp_module import _checkpoint_module

    ref = dsv4_mtp.save_checkpoint(str(tmp_path))
    _, module, sources = _checkpoint_module(str(tmp_path), torch.float64, 0, "eager", "meta")

    index = module.layer_index
    expected = {f"model.layers.{index}.{n}": t for n, t in [*ref.block.named_parameters(), *ref.block.named_buffers()]}
    own = {"e_proj.weight": "e_proj", "h_proj.weight": "h_proj", "enorm.weight": "enorm", "hnorm.weight": "hnorm",
           "norm.weight": "norm", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
           "hc_head.hc_scale": "hc_head_scale"}
    expected.update({f"model.layers.{index}.{n}": ref.own[k] for n, k in own.items()})
    expected.update({"model.embed_tokens.weight": ref.embed, "lm_head.weight": ref.head})
    names = [n for n, _ in [*module.named_parameters(), *module.named_buffers()] if "rotary_emb" not in n]
    assert sorted(names) == sorted(expected)
    for name in names:
        value = read_local(sources[name], REPLICATE, 0, 1)
        assert torch.equal(value.to(torch.float64), expected[name].detach().to(torch.float64)), name


def test_v4_mtp_checks_name_the_missing_layer():
    """``check_mtp``: a V4 checkpoint holding ``mtp.0.e_proj.weight`` passes (its attention is not
    MLA); without it the refusal names both layouts' tensors."""
    from types import SimpleNamespace

    from dcpgraph.errors import ConfigError
    from dcpgraph.speculative.mtp import check_mtp

    facts = SimpleNamespace(extra={"num_nextn_predict_layers": 1}, architecture="DeepseekV4ForCausalLM",
                            num_layers=4, attention="gqa")
    check_mtp(facts, ["model.embed_tokens.weight", "mtp.0.e_proj.weight"], 4)
    check_mtp(facts, ["model.mtp.0.e_proj.weight"], 4)
    with pytest.raises(ConfigError, match=r"holds MTP weights for 0 layer.*mtp.I.e_proj.weight"):
        check_mtp(facts, ["model.embed_tokens.weight", "mtp.1.e_proj.weight"], 4)
