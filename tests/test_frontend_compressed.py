"""DeepSeek-V4 traces with its compressed layers (CSA/HCA) as canonical ops and gives HF's own
logits over whole prompts (the tiny model of ``tests/dsv4_models.py``: a window shorter than the
prompts, entries of 2 and 4 tokens, ``index_topk`` smaller than the entries, hash and learned MoE,
``hc_mult = 2``): the reference is HF's forward on the same weights, its compressors in their
stateless whole-prompt mode. The cached layer: ``test_compile_compressed``."""

from __future__ import annotations

import functools

import dsv4_models
import pytest
import torch
from hybrid_mesh_checks import count as _count
from hybrid_mesh_checks import forward as _run

import dcpgraph
from dcpgraph.errors import UnsupportedModelError
from dcpgraph.frontends.compressed_layers import canonical_compressed_layers, compressed_modules

DCP = torch.ops.dcpgraph
# Exporting the 4-layer V4 takes 30-70 s on 2 shared cores: the trace tests run in the slow tier.
slow_export = pytest.mark.slow


@functools.cache
def _traced():
    model = dsv4_models.build()
    return model, dcpgraph.trace(model)


def test_canonical_layers_run_eagerly_give_hf_logits():
    """The canonical forward of the compressed layers (what export records), run eagerly inside
    HF's model: the default tier's check of the front end's math, without the export."""
    model = dsv4_models.build()
    ids = torch.tensor([list(dsv4_models.PROMPTS[3])])
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        with canonical_compressed_layers(model) as layers:
            got = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    assert sorted(layers) == [1, 2, 3]
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)
    assert not any("forward" in vars(m) for _, m in compressed_modules(model).values())  # restored


@slow_export
def test_v4_traces_to_canonical_ops():
    model, program = _traced()
    assert program.facts.extra["compressed_layers"] == {1: "heavily_compressed_attention",
                                                        2: "compressed_sparse_attention",
                                                        3: "heavily_compressed_attention"}
    assert _count(program, DCP.attention.default) == 1  # the sliding-only layer: window and sinks
    assert _count(program, DCP.compressed_attention.default) == 3
    assert _count(program, DCP.compress_windows.default) == 4  # three compressors and CSA's indexer
    assert _count(program, DCP.compressed_topk.default) == 1


@slow_export
@pytest.mark.parametrize("prompt", [*dsv4_models.PROMPTS, tuple(range(5)), tuple(range(2, 40))])
def test_v4_trace_gives_hf_logits(prompt):
    """Any length: the export range starts at 8 tokens (two entries of the largest rate) but the
    graph runs at 1 token, at 5 (no HCA entry yet) and past several windows."""
    model, program = _traced()
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=torch.arange(ids.shape[1]).unsqueeze(0), use_cache=False).logits
    torch.testing.assert_close(_run(program, ids), ref, atol=1e-10, rtol=1e-10)


def test_a_compressor_missing_a_part_is_not_recognised():
    model = dsv4_models.build()
    del model.model.layers[1].self_attn.compressor.position_bias
    assert sorted(compressed_modules(model)) == [2, 3]
    with pytest.raises(UnsupportedModelError, match=r"DeepSeek-V4 compressed attention \(CSA/HCA\).*at layers \[1\]"):
        dcpgraph.trace(model)


@pytest.mark.parametrize("tokens", [1, 3, 9])  # no entry, no entry of the larger rate, several
def test_fake_kernels_give_the_real_shapes(tokens):
    """Export records the ops through their fake kernels: same shapes and dtypes as the kernels,
    at token counts with and without closed windows."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    gen = torch.Generator().manual_seed(0)

    def args():
        r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
        positions = torch.arange(tokens).unsqueeze(0)
        pooled = DCP.compress_windows(r(1, tokens, 8), r(1, tokens, 8), r(4, 8), 4, True)
        keys = DCP.compress_windows(r(1, tokens, 6), r(1, tokens, 6), r(2, 6), 2, False)
        chosen = DCP.compressed_topk(r(1, tokens, 2, 6), r(1, tokens, 2), keys, positions, 0.5, 2, 3)
        out = DCP.compressed_attention(r(1, 2, tokens, 4), r(1, 1, tokens, 4), pooled, positions, r(2), 0.5, 3, 4,
                                       None)
        return pooled, keys, chosen, out

    real = args()
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = args()
    assert [(tuple(t.shape), t.dtype) for t in fake] == [(tuple(t.shape), t.dtype) for t in real]
    assert tuple(real[0].shape) == (1, tokens, 4) and tuple(real[2].shape) == (1, tokens, 3)
