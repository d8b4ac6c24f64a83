"""A whole Mamba-2 mixer (:func:`dcpgraph.ops.mamba2_layer.mamba2_mixer`) over varlen steps with
per-request state equals HF's own mixer module run on each request's whole sequence: bamba,
nemotron_h, granitemoehybrid and falcon_h1 (its µP multipliers, with and without the gated norm,
norm before or after the gate), across prefill chunks, decode steps and several requests in one
step. The recogniser refuses another activation by name; the state layout's byte formula matches
the tensors HF's own cache holds after a forward; the TP shards' partial outputs sum to the
mixer's."""

import pytest
import torch

from dcpgraph.errors import UnsupportedModelError
from dcpgraph.frontends import mamba2
from dcpgraph.frontends.recurrent_layers import recurrent_modules
from dcpgraph.ops.mamba2_layer import mamba2_mixer, mamba2_tp_rule
from dcpgraph.recurrent_state import Mamba2Shape

transformers = pytest.importorskip("transformers")

from hybrid_models import MAMBA2_MODELS  # noqa: E402 - after the transformers check

# Two requests: A's 11-token prompt in chunks of 5 and 6 then two decode steps; B's 7-token
# prompt beside A's second chunk, then one decode step beside A's.
SCHEDULE = [[("a", 5)], [("a", 6), ("b", 7)], [("a", 1), ("b", 1)], [("a", 1)]]


def _falcon(**options):
    config = transformers.FalconH1Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
        mamba_d_state=8, mamba_chunk_size=4, ssm_in_multiplier=0.7, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9],
        initializer_range=0.2, **options)
    torch.manual_seed(1)
    return transformers.FalconH1ForCausalLM(config).eval()


BUILDERS = {**MAMBA2_MODELS,
            "falcon_h1_norm_after_gate": lambda: _falcon(mamba_rms_norm=True, mamba_norm_before_gate=False),
            "falcon_h1_norm_before_gate": lambda: _falcon(mamba_rms_norm=True, mamba_norm_before_gate=True),
            "falcon_h1_multipliers_no_norm": lambda: _falcon(mamba_rms_norm=False)}


def _mixer(name):
    return next(module for kind, module in recurrent_modules(BUILDERS[name]()).values() if kind == "mamba2")


def _step_metadata(step, seen, slot_of):
    cu, slots, context = [0], [], []
    for request, n in step:
        cu.append(cu[-1] + n)
        slots.append(slot_of[request])
        context.append(seen[request])
    return (torch.tensor(slots), torch.tensor(cu, dtype=torch.int32), torch.tensor(context, dtype=torch.int32))


@pytest.mark.parametrize("name", list(BUILDERS))
def test_mixer_over_chunks_and_decode_steps_matches_hf(name):
    module = _mixer(name)
    weights = mamba2.canonical_weights(module)
    shape = mamba2.shape_of(module)
    gen = torch.Generator().manual_seed(0)
    lengths = {"a": sum(n for step in SCHEDULE for r, n in step if r == "a"),
               "b": sum(n for step in SCHEDULE for r, n in step if r == "b")}
    hidden = {r: torch.randn(n, module.hidden_size, generator=gen) for r, n in lengths.items()}
    slot_of = {"a": 2, "b": 0}
    conv_states = torch.full(shape.conv_state_shape(3)[:], float("nan"))
    ssm_states = torch.full(shape.ssm_state_shape(3), float("nan"))
    seen, outs = {"a": 0, "b": 0}, {"a": [], "b": []}
    with torch.no_grad():
        for step in SCHEDULE:
            x = torch.cat([hidden[r][seen[r]: seen[r] + n] for r, n in step])
            y = mamba2_mixer(weights, x, conv_states, ssm_states, *_step_metadata(step, seen, slot_of))
            start = 0
            for r, n in step:
                outs[r].append(y[start: start + n])
                start += n
                seen[r] += n
        for r in ("a", "b"):
            ref = module(hidden[r][None])[0]
            torch.testing.assert_close(torch.cat(outs[r]), ref, atol=2e-5, rtol=2e-5)
    assert torch.isnan(ssm_states[1]).all()  # no request holds slot 1


def test_mamba2_state_bytes_match_what_hf_cache_holds():
    """HF's cache after a forward holds, per Mamba-2 layer, the SSM state ``[1, Hh, P, N]`` and a
    conv state over the same ``I + 2GN`` channels; dcpgraph keeps ``K−1`` of its columns (HF
    keeps ``K``: the conv's full window)."""
    model = MAMBA2_MODELS["bamba"]()
    out = model(torch.tensor([[3, 4, 5, 6, 7]]), use_cache=True)
    cache = out.past_key_values
    module = _mixer("bamba")
    shape = mamba2.shape_of(module)
    conv, ssm = cache.get_conv_state(0, state_idx=0), cache.get_recurrent_state(0, state_idx=0)
    assert tuple(ssm.shape) == shape.ssm_state_shape(1) and ssm.dtype == torch.float32
    assert conv.shape[:2] == shape.conv_state_shape(1)[:2]
    assert conv.shape[-1] == shape.conv_kernel  # HF keeps the full window; the next output needs K−1
    assert shape.state_bytes_per_request(torch.float32) == (3 * (64 + 2 * 2 * 8) + 8 * 8 * 8) * 4
    # bf16 conv state, fp32 SSM state; at tp=2 (dividing heads 8 and groups 2) half of each.
    assert shape.state_bytes_per_request(torch.bfloat16, tp=2) == 3 * (32 + 2 * 1 * 8) * 2 + 4 * 8 * 8 * 4
    assert Mamba2Shape(8, 8, 1, 8, 4).on_rank(2) == Mamba2Shape(8, 8, 1, 8, 4)  # tp ∤ groups: replicated


def test_mamba2_recogniser_refuses_other_activations_by_name():
    module = _mixer("bamba")
    module.activation = "gelu"
    with pytest.raises(UnsupportedModelError, match=r"conv activation 'gelu' is not supported; supported: \['silu'\]"):
        mamba2.canonical_weights(module)


def test_tp_rule_names_every_split_parameter():
    """The rule the TP pass will apply covers every tensor of the canonical weights that has a
    head, group or channel dimension."""
    names = {name for key in mamba2_tp_rule() for name in key.split(", ")}
    assert {"w_z", "w_xbc", "w_dt", "conv_weight", "a_log", "d", "dt_bias", "norm_weight", "out_proj"} <= names


@pytest.mark.parametrize("name", ["bamba", "nemotron_h", "falcon_h1_norm_before_gate", "falcon_h1_multipliers_no_norm"])
def test_tp_shards_partial_outputs_sum_to_the_whole_mixer(name):
    """Two ranks, each with its half of the heads and groups and its own state pools, over a
    prefill chunk and a decode step: their outputs sum to the unsharded mixer's. A group of 4
    does not divide the 2 groups: every rank holds the whole layer."""
    module = _mixer(name)
    full = mamba2.canonical_weights(module)
    shape = mamba2.shape_of(module)
    hidden = torch.randn(7, module.hidden_size, generator=torch.Generator().manual_seed(2))
    steps = [(slice(0, 6), [0]), (slice(6, 7), [6])]

    def run(weights, local):
        conv = torch.zeros(local.conv_state_shape(1))
        ssm = torch.zeros(local.ssm_state_shape(1))
        return torch.cat([mamba2_mixer(weights, hidden[piece], conv, ssm, torch.tensor([0]),
                                       torch.tensor([0, piece.stop - piece.start], dtype=torch.int32),
                                       torch.tensor(context, dtype=torch.int32)) for piece, context in steps])

    with torch.no_grad():
        whole = run(full, shape)
        parts = [run(mamba2.tp_shard(full, rank, 2), shape.on_rank(2)) for rank in range(2)]
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=2e-5, rtol=2e-5)
    assert mamba2.tp_shard(full, 1, 4) is full and shape.on_rank(4) == shape
    with pytest.raises(ValueError, match="rank 2 is outside a TP group of 2"):
        mamba2.tp_shard(full, 2, 2)
