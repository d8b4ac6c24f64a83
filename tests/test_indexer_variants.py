"""Indexer variants of the installed transformers beside DeepSeek-V3.2 / GLM-5 (``test_e2e_sfa``):
AXK2 has V3.2's lightning indexer and MLA, and is compiled by the same sparse front end (exact vs
HF ``generate``); the others are refused by name, saying what differs from V3.2's indexer:
HY-V4 adds attention sinks to its sparse layers, Qwen4-Exp's QSA keeps compressed key blocks
within a token budget, MiniMax-M3 selects key blocks per KV head."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from sfa_models import config as sfa_config  # noqa: E402

import dcpgraph  # noqa: E402
from dcpgraph.errors import UnsupportedModelError  # noqa: E402
from dcpgraph.frontends.layer_kinds import check_layer_types  # noqa: E402
from dcpgraph.frontends.recurrent_layers import declared_recurrent_layers  # noqa: E402
from dcpgraph.testing.generation import drain, hf_greedy  # noqa: E402

PROMPT = tuple((7 * i + 3) % 256 for i in range(19))  # longer than the indexer's top-k (4)
NEW_TOKENS = 5


def _sfa_variant(model_type: str, **extra) -> torch.nn.Module:
    """A tiny fp64 model of ``model_type`` with ``sfa_models``' DeepSeek-V3.2 dimensions."""
    values = {k: v for k, v in sfa_config().to_dict().items() if k not in ("model_type", "architectures")}
    config = transformers.AutoConfig.for_model(model_type, **values, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            mean, std = (1.0, 0.3) if "norm" in name else (0.0, 0.2)
            p.copy_(mean + std * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


@pytest.mark.slow  # a 2-layer MLA + MoE + indexer model generating: 30-90 s on a shared CPU
@pytest.mark.parametrize("tp, dcp", [(1, 1), (4, 4)])
def test_axk2_has_v32s_indexer_and_matches_hf(tp, dcp):
    model = _sfa_variant("axk2")
    program = dcpgraph.trace(model)
    assert any(n.target is torch.ops.dcpgraph.indexer_topk.default for n in program.graph_module.graph.nodes)
    engine = dcpgraph.compile(program, tp=tp, dcp=dcp, block_size=4, max_num_batched_tokens=8)
    engine.add_request(list(PROMPT), max_new_tokens=NEW_TOKENS)
    assert drain(engine)[0] == hf_greedy(model, PROMPT, NEW_TOKENS)


def test_hy_v4s_sparse_layers_with_sinks_are_refused_naming_the_sinks():
    model = _sfa_variant("hy_v4")
    with pytest.raises(UnsupportedModelError, match=r"sparse \(indexed\) attention with attention sinks"):
        dcpgraph.trace(model)


def test_qwen4_exp_qsa_is_refused_saying_what_differs():
    config = transformers.AutoConfig.for_model("qwen4_exp_text")
    with pytest.raises(UnsupportedModelError, match=r"compressed-block indexed attention \(QSA\).*lightning indexer"):
        check_layer_types(config, declared_recurrent_layers(config))


def test_minimax_m3_block_sparse_layers_are_refused_saying_what_differs():
    config = transformers.AutoConfig.for_model("minimax_m3_vl_text", layer_types=["minimax_m3_sparse", "full_attention"],
                                               num_hidden_layers=2)
    with pytest.raises(UnsupportedModelError, match=r"block-sparse indexed attention.*per-token top-k"):
        check_layer_types(config)
