"""Mamba-2 hybrids trace with their mixers as canonical ops (``causal_conv1d`` over ``[x | B | C]``
and ``mamba2_scan``) and give HF's own logits over a whole prompt longer than HF's scan chunk:
bamba, nemotron_h (``M*-E``: its MLP and MoE layers are attention-free and stateless),
granitemoehybrid and falcon_h1 (attention beside the mixer in every layer). An ``mlp`` layer that
holds state is not taken as stateless; the config-only check accepts ``mlp``/``moe`` layers only
in a config that declares Mamba-2 mixers."""

from types import SimpleNamespace

import pytest
import torch

import dcpgraph
from dcpgraph.errors import UnsupportedModelError
from dcpgraph.frontends.layer_kinds import check_layer_types
from dcpgraph.frontends.recurrent_layers import (
    declared_recurrent_layers,
    declared_stateless_layers,
    stateless_layers,
)

transformers = pytest.importorskip("transformers")

from hybrid_mesh_checks import count as _count  # noqa: E402
from hybrid_mesh_checks import forward as _run  # noqa: E402
from hybrid_models import MAMBA2_MODELS  # noqa: E402 - after the transformers check

DCP = torch.ops.dcpgraph
# model → (recurrent layers, attention ops, stateless layers)
EXPECTED = {
    "bamba": ({0: "mamba2", 2: "mamba2"}, 1, None),
    "nemotron_h": ({0: "mamba2"}, 1, [2, 3]),
    "granitemoehybrid": ({0: "mamba2", 2: "mamba2"}, 1, None),
    "falcon_h1": ({0: "mamba2", 1: "mamba2"}, 2, None),
}
SLOW = {"bamba", "nemotron_h", "granitemoehybrid"}  # ~10-30 s each on 2 shared cores


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in EXPECTED])
def test_mamba2_hybrid_traces_to_canonical_ops_with_hf_logits(name):
    model = MAMBA2_MODELS[name]()
    program = dcpgraph.trace(model)
    kinds, attention, stateless = EXPECTED[name]
    assert program.facts.extra["recurrent_layers"] == kinds
    assert program.facts.extra.get("stateless_layers") == stateless
    assert _count(program, DCP.mamba2_scan.default) == _count(program, DCP.causal_conv1d.default) == len(kinds)
    assert _count(program, DCP.attention.default) == attention
    ids = torch.randint(0, 64, (1, 19), generator=torch.Generator().manual_seed(1))  # HF's scan chunk is 4
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    torch.testing.assert_close(_run(program, ids), ref, atol=1e-4, rtol=1e-4)


def test_an_mlp_layer_holding_state_is_not_stateless():
    model = MAMBA2_MODELS["nemotron_h"]()
    types = list(model.config.layer_types)
    assert stateless_layers(model, types) == [2, 3]
    model.model.layers[2].mixer.conv = torch.nn.Conv1d(4, 4, 3, groups=4)  # a convolution: state across tokens
    assert stateless_layers(model, types) == [3]
    with pytest.raises(UnsupportedModelError, match=r"layer type 'mlp'.*at layers \[2\]"):
        dcpgraph.trace(model)


def test_config_only_check_takes_mlp_and_moe_layers_of_a_mamba2_config_as_stateless():
    config = transformers.NemotronHConfig(hybrid_override_pattern="M*-E")
    assert declared_recurrent_layers(config) == [0]
    assert declared_stateless_layers(config) == [2, 3]
    check_layer_types(config, declared_recurrent_layers(config) + declared_stateless_layers(config))
    no_mamba2 = SimpleNamespace(layer_types=["full_attention", "moe"])  # an attention-free MoE layer stays refused
    assert declared_stateless_layers(no_mamba2) == []
    with pytest.raises(UnsupportedModelError, match=r"attention-free MoE layers: not supported .*at layers \[1\]"):
        check_layer_types(no_mamba2, declared_stateless_layers(no_mamba2))
