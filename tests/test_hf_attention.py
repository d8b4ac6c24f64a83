"""The keyword classification of dcpgraph's HF attention implementation.

Every keyword the installed transformers passes to an attention implementation is semantics-free,
implemented or refused by name; an unknown one is refused naming it; a semantics-free one never
blocks (whatever its value), and a refused one blocks only when it asks for its feature.
"""

from __future__ import annotations

import glob
import os
import re

import pytest
import torch

from dcpgraph.errors import UnsupportedModelError
from dcpgraph.frontends import hf_attention as hfa

transformers = pytest.importorskip("transformers")


def _attention_keywords_by_model() -> dict[str, set[str]]:
    """Keywords spelled out at ``attention_interface(...)`` call sites of every modeling file."""
    root = os.path.dirname(transformers.__file__)
    found: dict[str, set[str]] = {}
    for path in glob.glob(os.path.join(root, "models", "*", "modeling_*.py")):
        with open(path) as f:
            source = f.read()
        for call in re.finditer(r"attention_interface\((.*?)\n\s*\)", source, re.S):
            for kw in re.findall(r"(\w+)\s*=", call.group(1)):
                found.setdefault(kw, set()).add(os.path.basename(os.path.dirname(path)))
    return found


def _has_causal_lm(model_dir: str) -> bool:
    root = os.path.dirname(transformers.__file__)
    for path in glob.glob(os.path.join(root, "models", model_dir, "modeling_*.py")):
        with open(path) as f:
            if re.search(r"class \w+ForCausalLM\(", f.read()):
                return True
    return False


def test_every_keyword_of_a_causal_lm_attention_call_is_classified():
    found = _attention_keywords_by_model()
    assert {"scaling", "dropout", "sliding_window", "softcap", "s_aux"} <= set(found)
    unknown = {kw: models for kw, models in found.items() if hfa.classify_keyword(kw) == "unknown"}
    causal_unknown = {kw: sorted(m for m in models if _has_causal_lm(m)) for kw, models in unknown.items()}
    assert not {kw: m for kw, m in causal_unknown.items() if m}, causal_unknown


def test_every_transformers_kwargs_field_is_classified():
    from transformers.utils.generic import TransformersKwargs

    assert {k: hfa.classify_keyword(k) for k in TransformersKwargs.__annotations__ if hfa.classify_keyword(k) == "unknown"} == {}


class _Attn(torch.nn.Module):
    layer_idx = 3
    is_causal = True


def _call(**kw):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 8, dtype=torch.float64, generator=gen)
    k = torch.randn(1, 2, 5, 8, dtype=torch.float64, generator=gen)
    return hfa.dcpgraph_attention(_Attn(), q, k, k.clone(), None, **kw)


def test_semantics_free_keywords_never_block_and_match_plain_attention():
    plain, _ = _call(scaling=0.3)
    loud = {name: True for name in hfa.SEMANTICS_FREE}
    loud.update(position_ids=torch.arange(5)[None], max_length_q=5, is_causal=True)
    out, _ = _call(scaling=0.3, **loud)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(hfa.REFUSED))
def test_refused_keywords_name_their_feature_only_when_asked(name):
    _call(**{name: None})
    _call(**{name: False})
    with pytest.raises(UnsupportedModelError, match=rf"layer 3 \(_Attn\): {re.escape(hfa.REFUSED[name])} \({name}="):
        _call(**{name: torch.ones(2)})


def test_unknown_keywords_are_refused_by_name():
    _call(frobnicate=None)
    with pytest.raises(UnsupportedModelError, match="unrecognised attention argument frobnicate=int"):
        _call(frobnicate=1)


def test_implemented_keywords_refuse_the_values_they_do_not_implement():
    with pytest.raises(UnsupportedModelError, match="dropout"):
        _call(dropout=0.1)
    with pytest.raises(UnsupportedModelError, match="non-causal"):
        _call(is_causal=False)
    q = torch.randn(1, 4, 5, 8)
    with pytest.raises(UnsupportedModelError, match="attention mask tensor"):
        hfa.dcpgraph_attention(_Attn(), q, q[:, :2], q[:, :2], torch.ones(1, 1, 5, 5))


def test_window_softcap_and_sinks_reach_the_op_and_match_the_dense_reference():
    from dcpgraph.testing.reference import dense_attention

    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    out, _ = _call(scaling=0.7, sliding_window=2, softcap=1.5, s_aux=sinks)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 8, dtype=torch.float64, generator=gen)
    k = torch.randn(1, 2, 5, 8, dtype=torch.float64, generator=gen)
    ref, _ = dense_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), k[0].transpose(0, 1), 0.7,
                             q_positions=torch.arange(5), window=2, softcap=1.5, sinks=sinks)
    torch.testing.assert_close(out[0], ref, rtol=0, atol=1e-12)
    plain, _ = _call(scaling=0.7)
    assert (plain - out).abs().max() > 1e-3


@pytest.mark.parametrize("kw,match", [
    (dict(sliding_window=-1), "sliding_window must be a non-negative int"),
    (dict(sliding_window=2.5), "sliding_window must be a non-negative int"),
    (dict(softcap=-1.0), "softcap must be a non-negative number"),
    (dict(s_aux=torch.zeros(3)), r"one logit per query head \(4,\), got \(3,\)"),
    (dict(sinks=torch.zeros(4, 1)), r"one logit per query head"),
])
def test_modifier_values_are_checked(kw, match):
    with pytest.raises(UnsupportedModelError, match=match):
        _call(**kw)
