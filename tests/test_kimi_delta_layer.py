"""A whole Kimi delta attention layer (:func:`dcpgraph.ops.kimi_delta_layer.kimi_delta_attention`)
over varlen steps with per-request state equals HF's own module run on each request's whole
sequence: kimi_linear (low-rank gates, softplus forget gate) and bailing_hybrid (full-rank gates,
its bounded forget gate and the softplus one), across prefill chunks, decode steps and several
requests in one step. The state layout's byte formula matches the tensors HF's own cache holds; other activations and biases are refused
by name."""

import pytest
import torch

from dcpgraph.errors import UnsupportedModelError
from dcpgraph.frontends import kimi_delta
from dcpgraph.frontends.recurrent_layers import recurrent_modules
from dcpgraph.ops.kimi_delta_layer import kimi_delta_attention
from dcpgraph.recurrent_state import KimiDeltaShape

transformers = pytest.importorskip("transformers")

from hybrid_models import bailing_hybrid, kimi_linear  # noqa: E402 - after the transformers check

BUILDERS = {"kimi_linear": kimi_linear, "bailing_hybrid": bailing_hybrid,
            "bailing_hybrid_softplus_gate": lambda: bailing_hybrid(kda_safe_gate=False)}
# Two requests: A's 11-token prompt in chunks of 5 and 6 then two decode steps; B's 7-token
# prompt beside A's second chunk, then one decode step beside A's.
SCHEDULE = [[("a", 5)], [("a", 6), ("b", 7)], [("a", 1), ("b", 1)], [("a", 1)]]


def _kda(model):
    return next(module for kind, module in recurrent_modules(model).values() if kind == "kimi delta attention")


def _step_metadata(step, seen, slot_of):
    cu, slots, context = [0], [], []
    for request, n in step:
        cu.append(cu[-1] + n)
        slots.append(slot_of[request])
        context.append(seen[request])
    return torch.tensor(slots), torch.tensor(cu, dtype=torch.int32), torch.tensor(context, dtype=torch.int32)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_layer_over_chunks_and_decode_steps_matches_hf(name):
    module = _kda(BUILDERS[name]())
    weights = kimi_delta.canonical_weights(module)
    shape = kimi_delta.shape_of(module)
    gen = torch.Generator().manual_seed(0)
    lengths = {r: sum(n for step in SCHEDULE for q, n in step if q == r) for r in ("a", "b")}
    hidden = {r: torch.randn(n, module.hidden_size, generator=gen) for r, n in lengths.items()}
    slot_of = {"a": 2, "b": 0}
    conv_states = torch.full(shape.conv_state_shape(3), float("nan"))
    recurrent_states = torch.full(shape.recurrent_state_shape(3), float("nan"))
    seen, outs = {"a": 0, "b": 0}, {"a": [], "b": []}
    with torch.no_grad():
        for step in SCHEDULE:
            x = torch.cat([hidden[r][seen[r]: seen[r] + n] for r, n in step])
            y = kimi_delta_attention(weights, x, conv_states, recurrent_states, *_step_metadata(step, seen, slot_of),
                                     scan_chunk=4)
            start = 0
            for r, n in step:
                outs[r].append(y[start: start + n])
                start += n
                seen[r] += n
        for r in ("a", "b"):
            ref = module(hidden_states=hidden[r][None])[0]
            torch.testing.assert_close(torch.cat(outs[r]), ref, atol=2e-5, rtol=2e-5)
    assert torch.isnan(recurrent_states[1]).all()  # no request holds slot 1


def test_kda_state_bytes_match_what_hf_cache_holds():
    """HF's cache after a forward holds, per KDA layer, the recurrent state ``[1, H, D, D]`` in
    fp32 and a conv state over the same ``3·H·D`` channels; dcpgraph keeps ``K−1`` of its
    columns (HF keeps ``K``)."""
    model = kimi_linear()
    cache = model(torch.tensor([[3, 4, 5, 6, 7]]), use_cache=True).past_key_values
    shape = kimi_delta.shape_of(_kda(model))
    conv, recurrent = cache.get_conv_state(0, state_idx=0), cache.get_recurrent_state(0, state_idx=0)
    assert tuple(recurrent.shape) == shape.recurrent_state_shape(1) and recurrent.dtype == torch.float32
    assert conv.shape[:2] == shape.conv_state_shape(1)[:2] and conv.shape[-1] == shape.conv_kernel
    assert shape == KimiDeltaShape.from_config(model.config) == KimiDeltaShape(4, 8, 4)
    assert shape.state_bytes_per_request(torch.float32) == (3 * 3 * 32 + 4 * 8 * 8) * 4
    # bf16 conv state, fp32 recurrent state; at tp=2 (dividing the 4 heads) half of each; tp=8 replicates.
    assert shape.state_bytes_per_request(torch.bfloat16, tp=2) == 3 * 3 * 16 * 2 + 2 * 8 * 8 * 4
    assert shape.on_rank(8) == shape


def test_kda_recogniser_refuses_other_activations_and_biases_by_name():
    module = _kda(kimi_linear())
    module.activation = "gelu"
    with pytest.raises(UnsupportedModelError, match=r"conv activation 'gelu' is not supported; supported: \['silu'\]"):
        kimi_delta.canonical_weights(module)
    module.activation = "silu"
    module.b_proj.bias = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(UnsupportedModelError, match="projection biases are not supported"):
        kimi_delta.canonical_weights(module)
