"""LFM2's short-convolution layer (canonical weights + ``causal_conv1d_``) against HF's own
``Lfm2ShortConv``: prefill chunks and decode steps carrying the conv state, two requests in one
step, and TP shares (with and without biases) that sum to HF's output with 1/tp of the state."""

import pytest
import torch

from dcpgraph.errors import UnsupportedModelError
from dcpgraph.frontends.short_conv import canonical_weights, shape_of, tp_shard
from dcpgraph.ops.short_conv_layer import short_conv
from dcpgraph.recurrent_state import ShortConvShape

lfm2 = pytest.importorskip("transformers.models.lfm2.modeling_lfm2")
from transformers import Lfm2Config  # noqa: E402

HIDDEN = 12


def _module(bias: bool, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = Lfm2Config(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                        conv_bias=bias, conv_L_cache=3, layer_types=["conv", "full_attention"])
    module = lfm2.Lfm2ShortConv(config, layer_idx=0).eval()
    if bias:  # HF's init may zero biases: make them count
        with torch.no_grad():
            for p in (module.in_proj.bias, module.conv.bias, module.out_proj.bias):
                p.normal_()
    return module


def _step(w, pool, rows):
    """``rows`` = [(slot, context_len, hidden [n, H])] in one step; each row's output."""
    cu = [0]
    for _, _, x in rows:
        cu.append(cu[-1] + x.shape[0])
    out = short_conv(w, torch.cat([x for _, _, x in rows]), pool, torch.tensor([s for s, _, _ in rows]),
                     torch.tensor(cu, dtype=torch.int32), torch.tensor([c for _, c, _ in rows], dtype=torch.int32))
    return [out[cu[i]: cu[i + 1]] for i in range(len(rows))]


@pytest.mark.parametrize("bias", [False, True])
def test_short_conv_matches_hf_across_chunks_and_decode(bias):
    module = _module(bias)
    w = canonical_weights(module)
    gen = torch.Generator().manual_seed(1)
    xa, xb = torch.randn(9, HIDDEN, generator=gen), torch.randn(4, HIDDEN, generator=gen)
    with torch.no_grad():
        ref_a, ref_b = module(xa[None])[0], module(xb[None])[0]
        pool = torch.full(shape_of(module).conv_state_shape(2), float("nan"))
        a1, = _step(w, pool, [(1, 0, xa[:5])])
        a2, b1 = _step(w, pool, [(1, 5, xa[5:7]), (0, 0, xb[:3])])
        a3, b2 = _step(w, pool, [(1, 7, xa[7:8]), (0, 3, xb[3:4])])
        a4, = _step(w, pool, [(1, 8, xa[8:9])])
    torch.testing.assert_close(torch.cat([a1, a2, a3, a4]), ref_a, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat([b1, b2]), ref_b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tp", [2, 5])
def test_short_conv_tp_shares_sum_to_hf(bias, tp):
    """tp=2 splits the 12 channels; tp=5 does not divide them: every rank holds the whole layer."""
    module = _module(bias, seed=3)
    full, shape = canonical_weights(module), shape_of(module)
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(2))
    outs = []
    with torch.no_grad():
        ref = module(x[None])[0]
        for rank in range(tp):
            w = tp_shard(full, rank, tp)
            pool = torch.zeros(ShortConvShape(w.conv_weight.shape[0], 3).conv_state_shape(1))
            first, = _step(w, pool, [(0, 0, x[:6])])
            second, = _step(w, pool, [(0, 6, x[6:])])
            outs.append(torch.cat([first, second]))
            assert pool[0].numel() * pool.element_size() == shape.state_bytes_per_request(torch.float32, tp)
    if shape.splits_over(tp):
        torch.testing.assert_close(sum(outs), ref, atol=1e-5, rtol=1e-4)
        assert shape.state_bytes_per_request(torch.float32, tp) * tp == shape.state_bytes_per_request(torch.float32)
    else:
        for out in outs:
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_short_conv_refuses_other_layouts_by_name():
    with pytest.raises(UnsupportedModelError, match="not a recognised short-convolution layout"):
        canonical_weights(torch.nn.Linear(2, 2))
