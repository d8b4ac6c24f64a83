"""Front end for DeepSeek sparse attention: HF's traced lightning indexer is recognised structurally
and becomes ``dcpgraph.indexer_topk`` + ``dcpgraph.sparse_attention``; the canonical program equals
HF's own forward (fp64 logits, bit for bit on these seeds) at token counts above ``index_topk``;
variants are refused by name (another score function); GLM-5's shared-indexer layers reuse the
earlier layer's selection."""

from __future__ import annotations

import pytest
import sfa_models
import torch
import transformers.models.deepseek_v32.modeling_deepseek_v32 as hf_v32

import dcpgraph
from dcpgraph.errors import UnsupportedModelError
from dcpgraph.frontends import hf_attention as hfa
from dcpgraph.passes.absorb_mla import absorb_mla
from dcpgraph.passes.manager import run_passes
from dcpgraph.program import USER
from dcpgraph.testing.generation import hf_reference

ops = torch.ops.dcpgraph
aten = torch.ops.aten


def _forward(program, ids: torch.Tensor) -> torch.Tensor:
    feeds = {"input_ids": ids, "position_ids": torch.arange(ids.shape[1]).unsqueeze(0)}
    args = [feeds[s.target] if s.kind == USER else program.state[s.target] for s in program.inputs]
    out = program.graph_module(*args)
    return out[0] if isinstance(out, (tuple, list)) else out


def _targets(program) -> list:
    return [n.target for n in program.graph_module.graph.nodes if n.op == "call_function"]


@pytest.fixture(scope="module")
def v32():
    model = sfa_models.build("deepseek_v32")
    return model, dcpgraph.trace(model)


def test_indexer_and_sparse_attention_are_canonical_per_layer(v32):
    _, program = v32
    targets = _targets(program)
    assert targets.count(ops.indexer_topk.default) == targets.count(ops.sparse_attention.default) == sfa_models.LAYERS
    for gone in (ops.causal_mask.default, aten.relu.default, ops.attention.default):
        assert gone not in targets
    graph = program.graph_module.graph
    for node in graph.nodes:  # the only top-k left is the MoE router's
        if node.target is aten.topk.default:
            assert ".mlp" in list(node.meta["nn_module_stack"].values())[-1][0], node.name
    for node in graph.nodes:
        if node.target is ops.indexer_topk.default:
            q, k, w, scale, topk = node.args
            assert (tuple(q.meta["val"].shape[2:]), k.meta["val"].shape[-1], w.meta["val"].shape[-1]) == (
                (sfa_models.INDEX_HEADS, sfa_models.INDEX_DIM), sfa_models.INDEX_DIM, sfa_models.INDEX_HEADS)
            assert scale == sfa_models.INDEX_DIM ** -0.5 and topk == sfa_models.TOPK
    assert program.facts.attention == "mla"
    assert "sparse-indexer" in program.provenance[-1].summary


@pytest.mark.parametrize("tokens", [2, 5, 23])
def test_canonical_program_equals_hf_forward(v32, tokens):
    model, program = v32
    ids = torch.tensor([[(5 * i + 11) % sfa_models.VOCAB for i in range(tokens)]])
    with torch.no_grad(), hf_reference(model):
        want = model(ids).logits
    torch.testing.assert_close(_forward(program, ids), want, rtol=0, atol=1e-12)


def test_absorbed_sparse_program_equals_hf_forward(v32):
    model, program = v32
    absorbed = run_passes(program, [absorb_mla])
    targets = _targets(absorbed)
    assert targets.count(ops.sparse_attention.default) == sfa_models.LAYERS
    for node in absorbed.graph_module.graph.nodes:
        if node.target is ops.sparse_attention.default:
            assert node.args[1].meta["val"].shape[1] == 1  # one latent KV head
    ids = torch.tensor([[(3 * i + 1) % sfa_models.VOCAB for i in range(17)]])
    with torch.no_grad(), hf_reference(model):
        want = model(ids).logits
    torch.testing.assert_close(_forward(absorbed, ids), want, rtol=0, atol=1e-9)


def test_the_selection_matters_at_these_sizes(v32):
    """With index_topk = 4 the program differs from dense MLA (same weights, keep-all indexer)."""
    model, program = v32
    dense = sfa_models.build("deepseek_v32", topk=64)
    ids = torch.tensor([[(5 * i + 11) % sfa_models.VOCAB for i in range(12)]])
    with torch.no_grad(), hf_reference(model), hf_reference(dense):
        sparse_logits, dense_logits = model(ids).logits, dense(ids).logits
    assert (sparse_logits[0, 4:] - dense_logits[0, 4:]).abs().max() > 1e-3
    torch.testing.assert_close(sparse_logits[0, :4], dense_logits[0, :4], rtol=0, atol=1e-12)


def test_an_indexer_without_relu_is_refused_by_name(monkeypatch):
    class NoRelu:
        def __getattr__(self, name):
            return torch.nn.functional.gelu if name == "relu" else getattr(torch.nn.functional, name)

    monkeypatch.setattr(hf_v32, "F", NoRelu())
    with pytest.raises(UnsupportedModelError, match=r"indexer per-head scores are not ReLU'd \(found aten.gelu"):
        dcpgraph.trace(sfa_models.build("deepseek_v32", layers=1))


def test_glm5_all_full_indexers_equal_hf_forward():
    model = sfa_models.build("glm_moe_dsa", indexer_types=["full", "full"])
    program = dcpgraph.trace(model)
    assert _targets(program).count(ops.indexer_topk.default) == 2
    ids = torch.tensor([[(7 * i + 2) % sfa_models.VOCAB for i in range(15)]])
    with torch.no_grad(), hf_reference(model):
        want = model(ids).logits
    torch.testing.assert_close(_forward(program, ids), want, rtol=0, atol=1e-12)


def test_glm5_shared_layers_read_the_earlier_layers_indexer_and_equal_hf_forward():
    """GLM-5's ``"shared"`` layers reuse the previous full layer's top-k: one ``indexer_topk``
    feeds both sparse attentions."""
    model = sfa_models.build("glm_moe_dsa", indexer_types=["full", "shared"])
    program = dcpgraph.trace(model)
    targets = _targets(program)
    assert targets.count(ops.indexer_topk.default) == 1 and targets.count(ops.sparse_attention.default) == 2
    (indexer,) = [n for n in program.graph_module.graph.nodes if n.target is ops.indexer_topk.default]
    assert len([u for u in indexer.users if u.target is ops.sparse_attention.default]) == 2
    ids = torch.tensor([[(7 * i + 2) % sfa_models.VOCAB for i in range(15)]])
    with torch.no_grad(), hf_reference(model):
        want = model(ids).logits
    torch.testing.assert_close(_forward(program, ids), want, rtol=0, atol=1e-12)


def test_only_dsa_models_get_a_mask_and_only_their_own_mask_passes():
    assert hfa.no_mask(batch_size=1, q_length=3, kv_length=3, allow_is_causal_skip=False, config=None) is None
    cfg = sfa_models.config()
    mask = hfa.no_mask(batch_size=1, q_length=3, kv_length=3, allow_is_causal_skip=False, config=cfg,
                       attention_mask=None, q_offset=0, kv_offset=0, device="cpu")
    assert mask.tolist() == [[[[True, False, False], [True, True, False], [True, True, True]]]]

    class _Attn(torch.nn.Module):
        layer_idx = 0
        is_causal = True

    q = torch.randn(1, 2, 3, 4)
    out, _ = hfa.dcpgraph_attention(_Attn(), q, q[:, :1], q[:, :1], mask)
    torch.testing.assert_close(out, hfa.dcpgraph_attention(_Attn(), q, q[:, :1], q[:, :1], None)[0])
    with pytest.raises(UnsupportedModelError, match="attention mask tensor"):
        hfa.dcpgraph_attention(_Attn(), q, q[:, :1], q[:, :1], mask.clone())
    with pytest.raises(UnsupportedModelError, match="sparse .indexed. attention with a sliding window"):
        hfa.dcpgraph_attention(_Attn(), q, q[:, :1], q[:, :1], None, indices=torch.zeros(1, 3, 2), sliding_window=2)
