"""Front ends: HF models and plain ``nn.Module``s traced into canonical-attention Programs.

Per model (each traced once per module, in fixtures, because ``torch.export`` costs ~1 s):

1. numeric equivalence: the Program's graph equals the eager model in fp32 (atol 1e-5) at several
   token counts (the token dim is dynamic);
2. structure: one ``dcpgraph.attention`` per layer, no SDPA / softmax attention left, facts read
   off the graph (GQA heads recovered through ``enable_gqa``, ``repeat_interleave`` and HF's
   ``repeat_kv``);
3. refusals: every unsupported attention raises :class:`UnsupportedModelError` naming where and
   what (HF: Gemma2's sliding window / soft-capping, non-causal layers; plain modules: non-causal
   SDPA, dropout, masks that are not causal or not provably so, escaping scores, no attention).
"""

from __future__ import annotations

import gc
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dcpgraph
from dcpgraph.errors import UnsupportedModelError
from dcpgraph.frontends import fx as fx_frontend
from dcpgraph.frontends.canonicalize import raw_attention
from dcpgraph.testing.generation import hf_reference

VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS = 128, 64, 4, 2, 2
TOKEN_COUNTS = (2, 5, 13)
ATTENTION = torch.ops.dcpgraph.attention.default


# -- running a Program -------------------------------------------------------------------------------
def run_program(program, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    args = []
    for spec in program.inputs:
        if spec.kind == "user":
            args.append(ids if spec.target == "input_ids" else positions)
        else:
            args.append(program.state[spec.target])
    with torch.no_grad():
        out = program.graph_module(*args)
    return out[0] if isinstance(out, (tuple, list)) else out


def eager_logits(model, ids, positions):
    with torch.no_grad():
        if hasattr(model, "config"):
            with hf_reference(model):
                return model(input_ids=ids, position_ids=positions).logits
        return model(ids, positions)


def attention_nodes(program):
    return [n for n in program.graph_module.graph.nodes if n.op == "call_function" and n.target is ATTENTION]


# -- tiny plain modules ------------------------------------------------------------------------------
class Attention(nn.Module):
    """One attention block; ``mode`` picks how attention is written.

    sdpa / sdpa_mha: ``F.scaled_dot_product_attention(is_causal=True)`` (GQA via ``enable_gqa``)
    sdpa_mask:       SDPA with an explicit boolean ``tril`` mask (provably causal)
    tril:            matmul → /√d → masked_fill(~tril buffer) → softmax → matmul, K/V by
                     ``repeat_interleave``
    triu:            matmul → ·scale → + (-inf triu mask) → softmax → matmul, MHA
    where:           HF's ``repeat_kv`` (expand + reshape), ``where(tril, s, -inf)``, fp32 softmax
                     cast back
    """

    def __init__(self, mode: str, heads: int = HEADS, kv_heads: int = KV_HEADS, max_len: int = 64):
        super().__init__()
        if mode in ("sdpa_mha", "triu"):
            kv_heads = heads
        self.mode, self.h, self.kvh, self.hd = mode, heads, kv_heads, HIDDEN // heads
        self.q = nn.Linear(HIDDEN, heads * self.hd, bias=False)
        self.k = nn.Linear(HIDDEN, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(HIDDEN, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(heads * self.hd, HIDDEN, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.kvh, self.hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.kvh, self.hd).transpose(1, 2)
        rep = self.h // self.kvh
        if self.mode in ("sdpa", "sdpa_mha"):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=rep > 1)
        elif self.mode == "sdpa_mask":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.tril[:t, :t], enable_gqa=rep > 1)
        elif self.mode == "tril":
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            s = q @ k.transpose(-2, -1) / math.sqrt(self.hd)
            s = s.masked_fill(~self.tril[:t, :t], float("-inf"))
            o = torch.softmax(s, dim=-1) @ v
        elif self.mode == "triu":
            mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)
            s = torch.matmul(q, k.transpose(2, 3)) * self.hd**-0.5 + mask
            o = torch.matmul(F.softmax(s, dim=-1), v)
        elif self.mode == "where":
            k = k[:, :, None].expand(b, self.kvh, rep, t, self.hd).reshape(b, self.h, t, self.hd)
            v = v[:, :, None].expand(b, self.kvh, rep, t, self.hd).reshape(b, self.h, t, self.hd)
            s = torch.matmul(q, k.transpose(2, 3)) * self.hd**-0.5
            s = torch.where(self.tril[:t, :t], s, float("-inf"))
            p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
            o = torch.matmul(F.dropout(p, 0.1, training=self.training), v)
        else:
            o = self.broken(q, k, v, t)
        return self.o(o.transpose(1, 2).reshape(b, t, -1))

    def broken(self, q, k, v, t):
        """Variants that must be refused (see ``test_refuses``)."""
        rep = self.h // self.kvh
        if self.mode == "sdpa_noncausal":
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=rep > 1)
        if self.mode == "sdpa_dropout":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1, enable_gqa=rep > 1)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        s = q @ k.transpose(-2, -1) * self.hd**-0.5
        if self.mode == "no_mask":
            return torch.softmax(s, -1) @ v
        if self.mode == "sliding":
            window = self.tril[:t, :t] & ~torch.tril(torch.ones(t, t, dtype=torch.bool), diagonal=-3)
            return torch.softmax(s.masked_fill(~window, float("-inf")), -1) @ v
        if self.mode == "softcap":
            s = torch.tanh(s / 30.0) * 30.0
            return torch.softmax(s.masked_fill(~self.tril[:t, :t], float("-inf")), -1) @ v
        if self.mode == "escape":
            s = s.masked_fill(~self.tril[:t, :t], float("-inf"))
            # the masked scores are also used outside the attention
            return torch.softmax(s, -1) @ v + s.nan_to_num(0.0, 0.0, 0.0).mean()
        raise ValueError(self.mode)


class TinyLM(nn.Module):
    """``(input_ids [1, T], position_ids [1, T]) -> logits [1, T, V]`` with learned positions."""

    def __init__(self, mode: str, layers: int = LAYERS):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(256, HIDDEN)
        self.layers = nn.ModuleList([Attention(mode) for _ in range(layers)])
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, position_ids):
        x = self.emb(input_ids) + self.pos(position_ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(self.norm(x))


class NoAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, position_ids):
        return self.head(torch.relu(self.emb(input_ids)))


class IdsOnly(nn.Module):
    """``forward(input_ids)``: positions are implicit. NoPE (``arange=False``) is fine; deriving
    positions from ``arange(T)`` is refused (wrong for decode steps)."""

    def __init__(self, arange: bool):
        super().__init__()
        self.arange = arange
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(256, HIDDEN)
        self.attn = Attention("sdpa")
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        if self.arange:
            x = x + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))[None]
        return self.head(x + self.attn(x))


class ValueMask(TinyLM):
    """Causal only for increasing positions: the mask reads ``position_ids`` values."""

    def __init__(self):
        super().__init__("sdpa")

    def forward(self, input_ids, position_ids):
        x = self.emb(input_ids) + self.pos(position_ids)
        mask = position_ids[0, None, :] <= position_ids[0, :, None]
        layer = self.layers[0]
        b, t, _ = x.shape
        q = layer.q(x).view(b, t, layer.h, layer.hd).transpose(1, 2)
        k = layer.k(x).view(b, t, layer.kvh, layer.hd).transpose(1, 2)
        v = layer.v(x).view(b, t, layer.kvh, layer.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.head(layer.o(o.transpose(1, 2).reshape(b, t, -1)))


PLAIN_MODES = ("sdpa", "sdpa_mha", "sdpa_mask", "tril", "triu", "where")


def _seeded(factory):
    torch.manual_seed(0)
    return factory().eval()


@pytest.fixture(scope="module")
def plain():
    """mode -> (model, program), each traced once."""
    out = {}
    for mode in PLAIN_MODES:
        model = _seeded(lambda mode=mode: TinyLM(mode))
        out[mode] = (model, dcpgraph.trace(model))
    return out


# -- tiny HF models ----------------------------------------------------------------------------------
def _hf_model(name: str):
    import transformers as tf

    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
    )
    config, cls = {
        "llama": (lambda: tf.LlamaConfig(**common), tf.LlamaForCausalLM),
        "qwen2": (lambda: tf.Qwen2Config(**common), tf.Qwen2ForCausalLM),  # q/k/v biases
        "qwen3": (lambda: tf.Qwen3Config(**common, head_dim=16), tf.Qwen3ForCausalLM),  # q/k norm
        "gemma2": (lambda: tf.Gemma2Config(**common, head_dim=16), tf.Gemma2ForCausalLM),
    }[name]
    torch.manual_seed(0)
    return cls(config()).eval()


HF_NAMES = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    out = {}
    for name in HF_NAMES:
        model = _hf_model(name)
        before = model.config._attn_implementation
        program = dcpgraph.trace(model)
        out[name] = (model, program, before)
    return out


# -- 1. numeric equivalence --------------------------------------------------------------------------
def _check_equivalent(model, program):
    gen = torch.Generator().manual_seed(1)
    for tokens in TOKEN_COUNTS:
        ids = torch.randint(0, VOCAB, (1, tokens), generator=gen)
        start = int(torch.randint(0, 100, (), generator=gen))
        positions = torch.arange(start, start + tokens).unsqueeze(0)
        expected = eager_logits(model, ids, positions)
        got = run_program(program, ids, positions)
        assert got.shape == (1, tokens, VOCAB)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", HF_NAMES)
def test_hf_program_equals_model(hf, name):
    model, program, _ = hf[name]
    _check_equivalent(model, program)


@pytest.mark.parametrize("mode", PLAIN_MODES)
def test_plain_program_equals_model(plain, mode):
    model, program = plain[mode]
    _check_equivalent(model, program)


# -- 2. structure and facts --------------------------------------------------------------------------
def _check_canonical(program):
    graph = program.graph_module.graph
    assert len(attention_nodes(program)) == program.facts.num_layers == LAYERS
    assert raw_attention(graph) == []
    left = {n.target for n in graph.nodes if n.op == "call_function"}
    for op in (torch.ops.aten.scaled_dot_product_attention.default, torch.ops.aten.softmax.int,
               torch.ops.aten._softmax.default):
        assert op not in left
    for node in attention_nodes(program):
        assert node.args[4] is True  # causal
    assert [name for name, _ in program.stages] == ["trace", "canonicalize_attention"]
    assert [r.name for r in program.provenance] == ["trace", "canonicalize_attention"]


@pytest.mark.parametrize("name", HF_NAMES)
def test_hf_structure(hf, name):
    model, program, before = hf[name]
    _check_canonical(program)
    assert model.config._attn_implementation == before  # the user's model is switched back
    assert program.facts.num_kv_heads == KV_HEADS and program.facts.tp_plan


@pytest.mark.parametrize("mode", PLAIN_MODES)
def test_plain_structure_and_facts(plain, mode):
    model, program = plain[mode]
    _check_canonical(program)
    f = program.facts
    kv = HEADS if mode in ("sdpa_mha", "triu") else KV_HEADS  # repeats were traced back
    assert (f.architecture, f.attention, f.num_q_heads, f.num_kv_heads) == ("TinyLM", "gqa", HEADS, kv)
    assert (f.head_dim, f.v_head_dim, f.vocab_size, f.hidden_size) == (16, 16, VOCAB, HIDDEN)
    assert f.extra["max_position_embeddings"] == 256  # rows of the embedding read by position_ids
    assert f.tp_plan == {}
    for node in attention_nodes(program):  # K/V feed attention un-repeated
        assert node.args[1].meta["val"].shape[1] == kv
    for node in attention_nodes(program):
        assert node.args[3] == pytest.approx(16**-0.5)


def test_hand_written_pattern_leaves_no_pattern_nodes(plain):
    _, program = plain["tril"]
    targets = [n.target for n in program.graph_module.graph.nodes if n.op == "call_function"]
    for op in ("matmul", "masked_fill", "softmax", "repeat_interleave", "bitwise_not"):
        assert not any(op in str(t) for t in targets), op
    assert "2 matmul-softmax" in program.provenance[-1].summary


def test_module_facts_are_cached_with_the_trace(plain):
    model, program = plain["sdpa"]
    assert fx_frontend.trace_module(model) is program
    assert dcpgraph.api.facts_of(model) is program.facts
    before = len(fx_frontend._cache)
    scratch = TinyLM("sdpa", layers=1).eval()
    facts = fx_frontend.module_facts(scratch)
    assert facts.num_layers == 1 and len(fx_frontend._cache) == before + 1
    del scratch, facts
    gc.collect()
    assert len(fx_frontend._cache) == before  # weakly held: the cache does not keep models alive


def test_tp_plan_attribute_becomes_facts():
    model = TinyLM("sdpa", layers=1).eval()
    model.tp_plan = {"layers.*.q": "colwise", "layers.*.o": "rowwise", "head": "colwise_gather_output"}
    assert fx_frontend.module_facts(model).tp_plan == model.tp_plan
    model = TinyLM("sdpa", layers=1).eval()
    model.tp_plan = {"layers.*.q": "sideways"}
    with pytest.raises(UnsupportedModelError, match="unknown rules"):
        fx_frontend.module_facts(model)


def test_ids_only_forward_is_wrapped_unless_positions_are_implicit():
    torch.manual_seed(0)
    nope = IdsOnly(arange=False).eval()
    program = dcpgraph.trace(nope)
    assert program.facts.num_layers == 1
    ids = torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():
        expected = nope(ids)
    torch.testing.assert_close(run_program(program, ids, torch.arange(7)[None]), expected, atol=1e-5, rtol=1e-5)
    assert "emb.weight" in program.state  # the wrapper's prefix is not in the state keys
    with pytest.raises(UnsupportedModelError, match="ignores position_ids"):
        dcpgraph.trace(IdsOnly(arange=True).eval())


# -- 3. refusals -------------------------------------------------------------------------------------
REFUSALS = [
    ("sdpa_noncausal", r"layers\.0 \(Attention\).*non-causal scaled_dot_product_attention"),
    ("sdpa_dropout", r"layers\.0 \(Attention\).*dropout"),
    ("no_mask", r"layers\.0 \(Attention\).*non-causal attention \(no mask"),
    ("sliding", r"layers\.0 \(Attention\).*hides positions the causal mask keeps"),
    ("softcap", r"layers\.0 \(Attention\).*unrecognised attention.*tanh"),
    # Behaviour chosen for escaping intermediates: refuse the model (no partial rewrite).
    ("escape", r"layers\.0 \(Attention\).*also used by .* outside the attention"),
]


@pytest.mark.parametrize(("mode", "message"), REFUSALS, ids=[m for m, _ in REFUSALS])
def test_refuses(mode, message):
    model = TinyLM(mode, layers=1).eval()
    with pytest.raises(UnsupportedModelError, match=message):
        dcpgraph.trace(model)


def test_refuses_masks_computed_from_input_values():
    with pytest.raises(UnsupportedModelError, match="computed from the values of input 'position_ids'"):
        dcpgraph.trace(ValueMask().eval())


def test_refuses_a_model_without_attention():
    with pytest.raises(UnsupportedModelError, match="NoAttention: no recognisable attention"):
        dcpgraph.trace(NoAttention().eval())
    with pytest.raises(UnsupportedModelError, match="no recognisable attention"):
        dcpgraph.api.facts_of(NoAttention().eval())


def test_hf_gemma2_traces_with_window_and_softcap_and_a_refusal_restores_the_implementation():
    pytest.importorskip("transformers")
    model = _hf_model("gemma2")
    before = model.config._attn_implementation
    program = dcpgraph.trace(model)  # sliding window + soft-cap become the op's arguments
    attn = [n for n in program.graph_module.graph.nodes if n.target is torch.ops.dcpgraph.attention.default]
    assert [n.args[5:7] for n in attn] == [(4096, 50.0), (0, 50.0)]  # (window, soft-cap) per layer
    assert model.config._attn_implementation == before
    model.model.layers[0].self_attn.is_causal = False
    with pytest.raises(UnsupportedModelError, match=r"layer 0 \(Gemma2Attention\): non-causal attention"):
        dcpgraph.trace(model)
    assert model.config._attn_implementation == before


def test_hf_refuses_non_causal_layers():
    pytest.importorskip("transformers")
    model = _hf_model("llama")
    model.model.layers[1].self_attn.is_causal = False
    with pytest.raises(UnsupportedModelError, match=r"layer 1 \(LlamaAttention\): non-causal attention"):
        dcpgraph.trace(model)
    assert model.config._attn_implementation != "dcpgraph"
