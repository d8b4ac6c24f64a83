"""The DeepSeek-V3 multi-token-prediction layer as an ``nn.Module``, and its traced Program.

For a checkpoint with ``num_hidden_layers = L``, MTP layer ``i`` lives at ``model.layers.{L+i}``.
At position ``t`` it reads the embedding of token ``t + 1`` and a hidden state ``h_t``::

    x   = eh_proj(concat(enorm(embed(token_{t+1})), hnorm(h_t)))
    x   = decoder_layer(x, position t)          # MLA attention over its own KV cache + MLP/MoE
    out = head(shared_head.norm(x))             # logits for token t + 2

and returns ``(logits, x)``. As in vLLM's DeepSeek MTP, ``h_t`` is the target model's final
hidden state **after** its final norm (the LM head's input) for the first draft, and the MTP's
own ``x`` (before ``shared_head.norm``) for each further draft. ``embed_tokens`` is the target's;
``head`` is ``shared_head.head`` when the checkpoint stores it, else the target's ``lm_head``.

The module is built on the meta device and traced like the main model (dcpgraph's attention,
``batched_mm`` experts, a dynamic token count), so the pass pipeline gives its attention a paged
KV cache and DCP; its weights are read per rank from the checkpoint by
:class:`~dcpgraph.checkpoints.loader.ShardedReader`. Parameter names equal the checkpoint's names, so
the target's TP plan (``model.layers.*.…``) applies unchanged. A DeepSeek-V4 checkpoint's layer
(:mod:`.mtp_v4_module`) is built, found in the checkpoint and traced through the same functions.
"""

from __future__ import annotations

import dataclasses

import torch

from ..checkpoints.files import weight_files
from ..checkpoints.loader import ShardedReader
from ..checkpoints.meta_trace import _on_device
from ..checkpoints.names import CheckpointNames
from ..checkpoints.quantization import dequantized_sources, fp8_block_size
from ..checkpoints.tensor_sources import InMemory, SafetensorsFiles, Stored, read_local
from ..errors import ConfigError
from ..frontends.compressed_layers import canonical_compressed_layers
from ..frontends.compressed_tp import v4_attention_tp_plan
from ..frontends.export import finish, program_from_export, run_export
from ..frontends.hf_attention import register
from ..program import REPLICATE, Program
from .mtp_v4_module import MTPModuleV4, is_v4_config, mtp_v4_config, mtp_v4_sources


def _classes():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    return m


class SharedHead(torch.nn.Module):
    def __init__(self, config, own_head: bool):
        super().__init__()
        m = _classes()
        self.norm = m.DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False) if own_head else None


def _mtp_layer_class():
    m = _classes()

    class MTPLayer(m.DeepseekV3DecoderLayer):
        """One decoder layer plus the MTP's own norms, projection and shared head."""

        def __init__(self, config, layer_idx: int, own_head: bool):
            super().__init__(config, layer_idx)
            self.enorm = m.DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.hnorm = m.DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.eh_proj = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
            self.shared_head = SharedHead(config, own_head)

    return MTPLayer


class MTPBody(torch.nn.Module):
    def __init__(self, config, layer_index: int, own_head: bool):
        super().__init__()
        m = _classes()
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleDict({str(layer_index): _mtp_layer_class()(config, layer_index, own_head)})
        self.rotary_emb = m.DeepseekV3RotaryEmbedding(config=config)


class MTPModule(torch.nn.Module):
    """``(input_ids [1, T], position_ids [1, T], hidden_states [1, T, H]) -> (logits [1, T, V],
    x [1, T, H])``: MTP layer ``layer_index`` (the module docstring's formula)."""

    def __init__(self, config, layer_index: int, own_head: bool = True):
        super().__init__()
        self.layer_index = layer_index
        self.model = MTPBody(config, layer_index, own_head)
        self.lm_head = None if own_head else torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def layer(self):
        return self.model.layers[str(self.layer_index)]

    def forward(self, input_ids, position_ids, hidden_states):
        layer = self.layer
        embeds = layer.enorm(self.model.embed_tokens(input_ids))
        x = layer.eh_proj(torch.cat([embeds, layer.hnorm(hidden_states)], dim=-1))
        rotary = self.model.rotary_emb(x, position_ids)
        x = layer(x, attention_mask=None, position_ids=position_ids, position_embeddings=rotary)
        head = layer.shared_head.head if layer.shared_head.head is not None else self.lm_head
        return head(layer.shared_head.norm(x)), x


class _TraceWrapper(torch.nn.Module):
    """The MTP module as the submodule ``model``, like the HF front end's wrapper, so module paths
    in the exported graph have the shape the TP passes expect (``model.<the module's own path>``)."""

    def __init__(self, module: MTPModule):
        super().__init__()
        self.model = module

    def forward(self, input_ids, position_ids, hidden_states):
        return self.model(input_ids, position_ids, hidden_states)


def mtp_config(config, attention: str):
    """A copy of the target's config for tracing or running the MTP layer: attention
    implementation ``attention`` ("dcpgraph" to trace, "sdpa" for an eager reference) and
    ``batched_mm`` experts (traceable, fp64-capable)."""
    import copy

    out = copy.deepcopy(config)
    out._attn_implementation = attention
    out._experts_implementation = "batched_mm"
    return out


def checkpoint_names(config, own_head: bool, tied: bool) -> dict[str, str]:
    """Module state names that are not stored under their own name -> the checkpoint tensor
    that holds them (the target's head when the MTP has none)."""
    if own_head:
        return {}
    return {"lm_head.weight": "model.embed_tokens.weight" if tied else "lm_head.weight"}


def mtp_facts(target_facts, layer_index: int, module: torch.nn.Module | None = None):
    """The MTP program's facts: the target's shapes, one attention layer, the target's TP plan
    (its ``model.layers.*`` keys match) with the shared head sharded like the LM head, and the
    per-module plan of a V4 attention in ``module`` (:mod:`~dcpgraph.frontends.compressed_tp`)
    and the width of its ``hidden_states`` input (``hc_mult`` streams); no compressed layers (a V4
    MTP block is sliding-window attention)."""
    plan = dict(target_facts.tp_plan)
    if "lm_head" in plan:
        plan[f"model.layers.{layer_index}.shared_head.head"] = plan["lm_head"]
    extra = {k: v for k, v in target_facts.extra.items() if k not in ("compressed_layers", "compress_rates")}
    extra = {**extra, "num_nextn_predict_layers": 0, "mtp_layer": layer_index}
    if module is not None:
        plan.update(v4_attention_tp_plan(module))
        extra["hidden_states_width"] = module.hc_mult * target_facts.hidden_size  # the streams, flattened
    return dataclasses.replace(target_facts, architecture=f"{target_facts.architecture}MTP", num_layers=1,
                               tp_plan=plan, extra=extra)


def trace_mtp(module: torch.nn.Module, facts, example_tokens: int = 8) -> Program:
    """The MTP module (V3's or V4's) as a canonical Program with user inputs ``input_ids``,
    ``position_ids`` and ``hidden_states`` (``hc_mult · hidden_size`` wide for V4's streams);
    works on meta parameters (the graph then runs on the CPU). A V4 attention's grouped output
    projection is traced with its group count taken from the local weight, as the target's."""
    register()
    device = next(module.parameters()).device
    dtype = next(module.parameters()).dtype
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, facts.vocab_size, (1, example_tokens), generator=gen).to(device)
    positions = torch.arange(example_tokens).unsqueeze(0).to(device)
    width = facts.extra.get("hidden_states_width") or facts.hidden_size
    hidden = torch.randn(1, example_tokens, width, generator=gen, dtype=dtype).to(device)
    tokens = torch.export.Dim("tokens", min=2, max=1 << 16)
    module.eval()
    with torch.no_grad(), canonical_compressed_layers(module):
        exported, seconds = run_export(_TraceWrapper(module).eval(), (ids, positions, hidden), {
            "input_ids": {1: tokens}, "position_ids": {1: tokens}, "hidden_states": {1: tokens}})
    program = program_from_export(exported, facts, prefix="model.", seconds=seconds,
                                  roles=("input_ids", "position_ids", "hidden_states"))
    if device.type == "meta":
        _on_device(program.graph_module.graph, torch.device("cpu"))
        program.graph_module.recompile()
    program = finish(program)
    return program.replace(lowering=program.lowering.decided(hidden_states_output=1))  # x, for chaining


def _checkpoint_module(path: str, dtype: torch.dtype, layer: int, attention: str, device: str):
    """``(config, MTP module on device, sources by module state name)`` for MTP layer ``layer``
    of the checkpoint at ``path`` (DeepSeek-V3's, or V4's: :mod:`.mtp_v4_module`); raises
    ConfigError naming tensors the checkpoint lacks."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(path)
    index = config.num_hidden_layers + layer
    files = SafetensorsFiles(path, weight_files(path))
    if is_v4_config(config):
        with torch.device(device):
            module = MTPModuleV4(mtp_v4_config(config, attention), index).to(dtype)
        sources = mtp_v4_sources(module, config, files, layer)
        return config, module, dequantized_sources(sources, files, fp8_block_size(config, path))
    own_head = f"model.layers.{index}.shared_head.head.weight" in files
    aliases = checkpoint_names(config, own_head, bool(getattr(config, "tie_word_embeddings", False)))
    with torch.device(device):
        module = MTPModule(mtp_config(config, attention), index, own_head).to(dtype)
    rotary = _classes().DeepseekV3RotaryEmbedding(config=config)  # buffers computed on the CPU
    computed = {f"model.rotary_emb.{n}": b for n, b in rotary.named_buffers()}
    sources, missing = {}, []
    names = CheckpointNames.for_model_type(getattr(config, "model_type", None))
    for name, value in [*module.named_parameters(), *module.named_buffers()]:
        stored = aliases.get(name, name)
        if stored in files:
            sources[name] = Stored(files, stored)
        elif name in computed:
            sources[name] = InMemory(computed[name], f"{name} (computed from the config)")
        else:
            fused = names.source(name, tuple(value.shape), files)  # per-expert tensors merged
            if fused is None:
                missing.append(stored)
            else:
                sources[name] = fused
    if missing:
        raise ConfigError(f"{path}: MTP layer {index} has no checkpoint tensor for {missing}")
    # fp8 checkpoints: the MTP layer's weights are dequantized like the model's
    return config, module, dequantized_sources(sources, files, fp8_block_size(config, path))


def check_mtp_weights(path: str) -> None:
    """Raise ConfigError unless the checkpoint at ``path`` holds every tensor of each of its MTP
    layers (reads headers only; the module is built on the meta device)."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(path)
    for layer in range(int(getattr(config, "num_nextn_predict_layers", 0) or 0)):
        _checkpoint_module(path, torch.float32, layer, "dcpgraph", "meta")


def load_mtp_program(path: str, target_facts, dtype: torch.dtype, layer: int = 0) -> Program:
    """MTP layer ``layer`` of the checkpoint at ``path``, traced on the meta device, with a
    reader that gives each rank its slices of the checkpoint's MTP tensors."""
    config, module, sources = _checkpoint_module(path, dtype, layer, "dcpgraph", "meta")
    v4 = module if is_v4_config(config) else None
    program = trace_mtp(module, mtp_facts(target_facts, config.num_hidden_layers + layer, v4))
    return program.replace(state_reader=ShardedReader(sources))


def eager_mtp_module(path: str, dtype: torch.dtype, layer: int = 0) -> MTPModule:
    """DeepSeek-V3's MTP layer ``layer`` of ``path`` as a plain CPU module with PyTorch SDPA
    (causal) attention: the eager reference for the compiled MTP program. A V4 layer is refused:
    its sliding-window attention needs an explicit mask, which the module's forward does not build."""
    import transformers as tf

    if is_v4_config(tf.AutoConfig.from_pretrained(path)):
        raise ValueError(f"{path}: eager_mtp_module builds DeepSeek-V3's MTP layer; a V4 MTP block attends over a "
                         "sliding window that needs an explicit mask")
    _, module, sources = _checkpoint_module(path, dtype, layer, "sdpa", "cpu")
    state = {name: read_local(source, REPLICATE, 0, 1).to(dtype) for name, source in sources.items()}
    persistent = module.state_dict()
    missing = sorted(set(persistent) - set(state))
    if missing:
        raise ValueError(f"no source for {missing}")
    module.load_state_dict({name: state[name].to(value.dtype) for name, value in persistent.items()}, strict=True)
    return module.eval()
