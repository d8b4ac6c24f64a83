"""Hybrid HF models trace with their recurrent layers as canonical ops: qwen3_next (gated delta
net + gated attention, dense MLPs) and lfm2 (short convolution + attention). The traced program
gives HF's own logits over a whole prompt (longer than the scan chunk); a recurrent layer kind the
front end does not recognise (Jamba's Mamba-1) stays refused by its layer type. The Mamba-2
hybrids' traces are checked in ``test_frontend_mamba2``."""

import pytest
import torch

import dcpgraph
from dcpgraph.errors import UnsupportedModelError

transformers = pytest.importorskip("transformers")

from hybrid_mesh_checks import count as _count  # noqa: E402
from hybrid_mesh_checks import forward as _run  # noqa: E402
from hybrid_models import lfm2 as _lfm2  # noqa: E402 - after the transformers check
from hybrid_models import qwen3_next as _qwen3_next  # noqa: E402

DCP = torch.ops.dcpgraph


@pytest.mark.parametrize("build, kinds, convs, rules", [
    pytest.param(_qwen3_next, {0: "gated delta net", 1: "gated delta net", 2: "gated delta net"}, 3, 3,
                 marks=pytest.mark.slow),  # ~20 s; its trace also runs in test_recurrent_program's default tier
    (_lfm2, {0: "short convolution", 2: "short convolution"}, 2, 0),
])
def test_hybrid_traces_to_canonical_ops_with_hf_logits(build, kinds, convs, rules):
    model = build()
    program = dcpgraph.trace(model)
    assert program.facts.extra["recurrent_layers"] == kinds
    assert _count(program, DCP.causal_conv1d.default) == convs
    assert _count(program, DCP.gated_delta_rule.default) == rules
    assert _count(program, DCP.attention.default) == len(model.config.layer_types) - len(kinds)
    ids = torch.randint(0, 64, (1, 70), generator=torch.Generator().manual_seed(1))  # > one 64-token scan chunk
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    torch.testing.assert_close(_run(program, ids), ref, atol=1e-4, rtol=1e-4)
    # HF's module is restored: its own forward runs again after the trace.
    layer = next(iter(kinds))
    assert "forward" not in vars(next(m for m in model.model.layers[layer].modules()
                                      if m is not model.model.layers[layer] and hasattr(m, "out_proj")))


def test_unrecognised_recurrent_layers_stay_refused_by_type():
    """Jamba's Mamba-1 mixer (``dt_proj``/``x_proj``, no ``dt_bias`` or gated norm) is no
    recognised kind: its ``linear_attention`` layer is refused by type."""
    config = transformers.JambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, num_experts=1,
        mamba_d_state=8)
    model = transformers.JambaForCausalLM(config).eval()
    with pytest.raises(UnsupportedModelError, match=r"recurrent layers \(Mamba/SSM.*at layers \[0\]"):
        dcpgraph.trace(model)
