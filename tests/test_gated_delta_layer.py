"""A whole gated delta net layer (canonical weights + the state ops) against HF's own module
(qwen3_next's fused, qwen3_5's split and olmo_hybrid's separate projections with β doubled): prompts split into prefill chunks and
decode steps that carry the state, several requests in one step, and TP shares that sum to the
layer's output with 1/tp of the state bytes (or the whole layer where tp does not divide the
key heads)."""

import pytest
import torch

from dcpgraph.errors import UnsupportedModelError
from dcpgraph.frontends.gated_delta_net import canonical_weights, shape_of, tp_shard
from dcpgraph.ops.gated_delta_layer import gated_delta_net
from dcpgraph.recurrent_state import GatedDeltaNetShape

next_modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
q35_modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
olmo_modeling = pytest.importorskip("transformers.models.olmo_hybrid.modeling_olmo_hybrid")
from transformers import OlmoHybridConfig, Qwen3NextConfig  # noqa: E402
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig  # noqa: E402

DIMS = dict(hidden_size=24, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=6, linear_conv_kernel_dim=4, num_attention_heads=2, num_key_value_heads=2,
            head_dim=8, layer_types=["linear_attention"], num_hidden_layers=1)


def _module(layout: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if layout == "qwen3_next":
        module = next_modeling.Qwen3NextGatedDeltaNet(Qwen3NextConfig(**DIMS), layer_idx=0)
    elif layout == "qwen3_5":
        module = q35_modeling.Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(**DIMS), layer_idx=0)
    else:
        config = OlmoHybridConfig(**{**DIMS, "num_hidden_layers": 2,  # it needs an attention layer
                                     "layer_types": ["linear_attention", "full_attention"]})
        module = olmo_modeling.OlmoHybridGatedDeltaNet(config, layer_idx=0)
        assert module.allow_neg_eigval  # transformers' default: β doubled
    with torch.no_grad():  # HF's init leaves dt_bias and the norm at ones: make them count
        module.dt_bias.normal_()
        (module.o_norm if layout == "olmo_hybrid" else module.norm).weight.normal_()
    return module.eval()


def _pools(w, slots: int = 3):
    """NaN-filled conv and recurrent pools for ``w``'s (per-rank) heads: a new request must not
    read a slot's stale contents."""
    shape = GatedDeltaNetShape(w.key_heads, w.value_heads, w.key_dim, w.value_dim, w.conv_weight.shape[-1])
    conv = torch.full(shape.conv_state_shape(slots), float("nan"))
    recurrent = torch.full(shape.recurrent_state_shape(slots), float("nan"))
    return conv, recurrent


def _step(w, pools, rows):
    """One step over ``rows`` = [(slot, context_len, new hidden states [n, H])], flattened in
    order; returns each row's output."""
    cu = [0]
    for _, _, x in rows:
        cu.append(cu[-1] + x.shape[0])
    out = gated_delta_net(w, torch.cat([x for _, _, x in rows]), *pools, torch.tensor([s for s, _, _ in rows]),
                          torch.tensor(cu, dtype=torch.int32),
                          torch.tensor([c for _, c, _ in rows], dtype=torch.int32), scan_chunk=4)
    return [out[cu[i]: cu[i + 1]] for i in range(len(rows))]


@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5", "olmo_hybrid"])
def test_layer_matches_hf_across_prefill_chunks_and_decode_steps(layout):
    """Two requests of 19 and 11 tokens: prefill chunks of at most 8 tokens, then decode steps,
    batched in shared steps; every output row equals HF's forward over the whole sequence."""
    module = _module(layout)
    w = canonical_weights(module)
    gen = torch.Generator().manual_seed(1)
    xa, xb = torch.randn(19, 24, generator=gen), torch.randn(11, 24, generator=gen)
    with torch.no_grad():
        ref_a, ref_b = module(xa[None])[0], module(xb[None])[0]
        pools = _pools(w)
        steps = [
            [(2, 0, slice(0, 8))],
            [(2, 8, slice(8, 16)), (0, 0, slice(0, 8))],
            [(2, 16, slice(16, 17)), (0, 8, slice(8, 10))],
            [(2, 17, slice(17, 18)), (0, 10, slice(10, 11))],
            [(2, 18, slice(18, 19))],
        ]
        got = {2: [], 0: []}
        for rows in steps:
            outs = _step(w, pools, [(slot, ctx, (xa if slot == 2 else xb)[piece]) for slot, ctx, piece in rows])
            for (slot, _, _), out in zip(rows, outs):
                got[slot].append(out)
    torch.testing.assert_close(torch.cat(got[2]), ref_a, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(got[0]), ref_b, atol=1e-5, rtol=1e-4)
    assert torch.isnan(pools[0][1]).all() and torch.isnan(pools[1][1]).all()  # slot 1 never used


@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5", "olmo_hybrid"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shares_sum_to_hf_with_state_bytes_per_formula(layout, tp):
    """tp=2 splits the 2 key heads (each rank: 1 key head, 2 value heads, its conv channels):
    the ranks' partial outputs sum to HF's, over a prefill chunk and a decode step. tp=4 does not
    divide them: every rank holds the whole layer and its output, and the whole state."""
    module = _module(layout, seed=5)
    full = canonical_weights(module)
    shape = shape_of(module)
    x = torch.randn(13, 24, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = module(x[None])[0]
        outs = []
        for rank in range(tp):
            w = tp_shard(full, rank, tp)
            pools = _pools(w, slots=1)
            first = _step(w, pools, [(0, 0, x[:12])])
            second = _step(w, pools, [(0, 12, x[12:])])
            outs.append(torch.cat(first + second))
            held = sum(p[0].numel() * p.element_size() for p in pools)
            assert held == shape.state_bytes_per_request(torch.float32, tp)
    if shape.splits_over(tp):
        torch.testing.assert_close(sum(outs), ref, atol=1e-5, rtol=1e-4)
        assert shape.state_bytes_per_request(torch.float32, tp) * tp == shape.state_bytes_per_request(torch.float32)
    else:
        for out in outs:
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
        assert shape.state_bytes_per_request(torch.float32, tp) == shape.state_bytes_per_request(torch.float32)


def test_state_bytes_formula_by_hand():
    """Qwen3-Next-80B's GDN (Hk 16, Hv 32, Dk = Dv = 128, K 4) in bf16 at tp 4:
    conv 3·(2·4·128 + 8·128)·2 = 12,288 B, recurrent 8·128·128·4 = 524,288 B."""
    shape = GatedDeltaNetShape(16, 32, 128, 128, 4)
    assert shape.state_bytes_per_request(torch.bfloat16, 4) == 12_288 + 524_288
    assert shape.on_rank(3) is shape  # 3 does not divide 16 key heads: replicated


def test_unknown_activation_and_layouts_are_refused_by_name():
    module = _module("qwen3_next")
    module.activation = "gelu"
    with pytest.raises(UnsupportedModelError, match="conv activation 'gelu' is not supported"):
        canonical_weights(module)
    with pytest.raises(UnsupportedModelError, match="not a recognised gated delta net layout"):
        canonical_weights(torch.nn.Linear(2, 2))
