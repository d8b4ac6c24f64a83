"""The DeepSeek-V4 multi-token-prediction layer as an ``nn.Module``, and where its weights lie.

transformers builds no V4 MTP layer (it ignores the checkpoint's ``mtp.*`` tensors). The layer
here follows DeepSeek's V4 inference code (``MTPBlock`` in the released ``inference/model.py``)
and vLLM's ``deepseek_v4_mtp.py``. For a target with ``num_hidden_layers = L`` and
``hc_mult = n`` streams, MTP layer ``i`` is stored under ``mtp.{i}.`` and reads, at position
``t``, the token ``t + 1`` and the target's **hyper-connection streams** ``S_t [n, D]`` after its
last decoder layer (the input of the target's ``hc_head``, before its final norm)::

    x   = h_proj(hnorm(S_t)) + e_proj(enorm(embed(token_{t+1})))   # broadcast over the n streams
    x   = block(x, position t)          # a V4 decoder layer: mHC, attention, mHC, learned MoE
    out = head(norm(hc_head(x)))        # logits for token t + 2

``hnorm`` normalises each stream; ``block`` is layer ``L + i`` of the released layout, whose
``compress_ratios`` entry is 0: sliding-window attention with sinks and no compressor (the
checkpoint has no compressor or indexer tensors for it), and a learned top-k router (its index
is past the hash-routed layers). ``hc_head`` is the MTP's own (``hc_head_fn/base/scale``), ``norm``
its own final norm; ``embed`` and ``head`` are the target's. The module returns ``(logits, x)``
with ``x`` flattened to ``[1, T, n·D]``: the input of the next chained draft (vLLM's chaining feeds
the MTP's own streams back as ``S``).

Module state names are the target's layout (``model.layers.{L+i}.self_attn.q_b_proj.weight``,
...), so the target's TP plan and the V4 attention plan apply; :func:`mtp_v4_sources` finds each
under the stored ``mtp.{i}.`` names through transformers' V4 renamings.
"""

from __future__ import annotations

import copy

import torch

from ..checkpoints.names import CheckpointNames, renamed
from ..checkpoints.tensor_sources import InMemory, Stored
from ..errors import ConfigError

MTP_BLOCK = ("sliding_attention", "moe")  # (layer type, MLP type) of an MTP layer's decoder block
# MTP-only tensors whose stored suffix the V4 renamings do not map to the module's name
OWN_NAMES = {"norm.weight": "norm.weight", "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base",
             "hc_head_scale": "hc_head.hc_scale"}


def _classes():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    return m


def is_v4_config(config) -> bool:
    return getattr(config, "model_type", None) == "deepseek_v4"


def mtp_v4_config(config, attention: str):
    """The target's config extended by its MTP layers' block types (transformers cuts
    ``layer_types`` at ``num_hidden_layers``), with attention implementation ``attention`` and
    ``batched_mm`` experts."""
    out = copy.deepcopy(config)
    extra = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    out.layer_types = list(config.layer_types) + [MTP_BLOCK[0]] * extra
    out.mlp_layer_types = list(config.mlp_layer_types) + [MTP_BLOCK[1]] * extra
    out._attn_implementation = attention
    out._experts_implementation = "batched_mm"
    return out


def _mtp_layer_class():
    m = _classes()

    class MTPLayerV4(m.DeepseekV4DecoderLayer):
        """A V4 decoder layer plus the MTP's norms, projections, ``hc_head`` and final norm."""

        def __init__(self, config, layer_idx: int):
            super().__init__(config, layer_idx)
            hidden = config.hidden_size
            self.enorm = m.DeepseekV4RMSNorm(hidden, eps=config.rms_norm_eps)
            self.hnorm = m.DeepseekV4RMSNorm(hidden, eps=config.rms_norm_eps)
            self.e_proj = torch.nn.Linear(hidden, hidden, bias=False)
            self.h_proj = torch.nn.Linear(hidden, hidden, bias=False)
            self.hc_head = m.DeepseekV4HyperHead(config)
            self.norm = m.DeepseekV4RMSNorm(hidden, eps=config.rms_norm_eps)

    return MTPLayerV4


class _Body(torch.nn.Module):
    def __init__(self, config, layer_index: int):
        super().__init__()
        m = _classes()
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleDict({str(layer_index): _mtp_layer_class()(config, layer_index)})
        self.rotary_emb = m.DeepseekV4RotaryEmbedding(config)


class MTPModuleV4(torch.nn.Module):
    """``(input_ids [1, T], position_ids [1, T], hidden_states [1, T, n·D]) -> (logits [1, T, V],
    x [1, T, n·D])``: MTP layer ``layer_index`` (the module docstring's formula)."""

    def __init__(self, config, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.hc_mult = int(config.hc_mult)
        self.model = _Body(config, layer_index)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def layer(self):
        return self.model.layers[str(self.layer_index)]

    def forward(self, input_ids, position_ids, hidden_states):
        layer = self.layer
        streams = hidden_states.unflatten(-1, (self.hc_mult, -1))  # [1, T, n, D]
        embeds = layer.e_proj(layer.enorm(self.model.embed_tokens(input_ids)))
        x = layer.h_proj(layer.hnorm(streams)) + embeds.unsqueeze(2)
        rotary = {kind: self.model.rotary_emb(x, position_ids=position_ids, layer_type=kind)
                  for kind in ("main", "compress")}
        x = layer(x, input_ids=input_ids, position_embeddings=rotary, position_ids=position_ids, attention_mask=None)
        return self.lm_head(layer.norm(layer.hc_head(x))), x.flatten(2)


def stored_prefix(files, layer: int) -> str | None:
    """``mtp.{layer}.`` as the released checkpoint stores it, or ``model.mtp.{layer}.`` (a
    checkpoint written under the causal LM's prefix): the one holding ``e_proj.weight``."""
    return next((p for p in (f"mtp.{layer}.", f"model.mtp.{layer}.") if f"{p}e_proj.weight" in files), None)


def _renamed(files, prefix: str, index: int, names: CheckpointNames) -> dict[str, str]:
    """Module name → stored name of every tensor under ``prefix``: ``mtp.{i}.<suffix>`` is read
    as ``model.layers.{index}.<suffix>`` and run through transformers' V4 renamings in order
    (``.attn.`` → ``.self_attn.``, ``.wq_a.`` → ``.q_a_proj.``, ...), except the MTP-only
    :data:`OWN_NAMES`."""
    out = {}
    for stored in files.names():
        if not stored.startswith(prefix):
            continue
        suffix = stored[len(prefix):]
        name = f"model.layers.{index}.{OWN_NAMES.get(suffix, suffix)}"
        out[name if suffix in OWN_NAMES else renamed(names.patterns, name)] = stored
    return out


def mtp_v4_sources(module: MTPModuleV4, config, files, layer: int) -> dict:
    """Sources by module state name for MTP layer ``layer``: its own tensors under
    ``mtp.{layer}.`` (per-expert tensors merged into the fused experts), the target's embedding
    and LM head, the rotary buffers computed from the config; ConfigError names what is missing."""
    prefix = stored_prefix(files, layer)
    if prefix is None:
        raise ConfigError(f"{files.path}: no MTP layer {layer} (no mtp.{layer}.e_proj.weight)")
    names = CheckpointNames.for_model_type("deepseek_v4")
    own = _renamed(files, prefix, module.layer_index, names)
    rotary = _classes().DeepseekV4RotaryEmbedding(config)  # buffers computed on the CPU
    computed = {f"model.rotary_emb.{n}": b for n, b in rotary.named_buffers()}
    sources, missing = {}, []
    layer_prefix = f"model.layers.{module.layer_index}."
    for name, value in [*module.named_parameters(), *module.named_buffers()]:
        if name in computed:
            sources[name] = InMemory(computed[name], f"{name} (computed from the config)")
            continue
        if not name.startswith(layer_prefix):  # the target's embedding and head
            found = Stored(files, name) if name in files else names.source(name, tuple(value.shape), files)
        elif name in own:
            found = Stored(files, own[name])
        else:
            found = names.merged(name, tuple(value.shape), files, own.get)
        if found is None:
            missing.append(name)
        else:
            sources[name] = found
    if missing:
        raise ConfigError(f"{files.path}: MTP layer {layer} ({prefix}*) has no checkpoint tensor for {missing}")
    return sources
