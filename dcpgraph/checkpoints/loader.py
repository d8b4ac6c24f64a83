"""Load a checkpoint shard by shard: trace on the meta device, then each rank reads its slices.

:func:`load_program` builds the HF model from its config on the meta device (no weights), traces
it (:func:`~.meta_trace.trace_on_meta`) and returns a Program whose ``state`` holds meta tensors
and whose ``state_reader`` is a :class:`ShardedReader`. After the pass pipeline,
``program.local_state(rank)`` reads, for every state entry, the slice the entry's
:class:`~dcpgraph.program.ShardRule` gives that rank, from the source :func:`model_sources`
resolved for it (the checkpoint tensor of the same name, the tied tensor, per-expert tensors
stacked into a fused expert parameter, a pass-derived entry of :attr:`Program.sources`, or a
buffer computed from the config), cast to the entry's dtype. A rank therefore holds its own
shard of the weights plus one slice being read.

:func:`check_checkpoint` resolves every parameter and buffer of the meta model and compares shapes
with the safetensors headers; missing, unexpected and mismatched tensors raise
:class:`~dcpgraph.errors.ConfigError` naming them, before any rank starts.
"""

from __future__ import annotations

import re

import torch

from ..errors import ConfigError
from ..program import STATE_KINDS, Program
from .composite import LanguageModelFiles, text_config_of
from .names import CheckpointNames
from .quantization import dequantized_sources, fp8_block_size
from .tensor_sources import (
    AbsorbedMLA,
    BlockDequantized,
    Concatenated,
    Dummy,
    InMemory,
    SafetensorsFiles,
    Stacked,
    Stored,
    read_local,
)


def meta_model(path: str, dtype: torch.dtype | None):
    """The HF causal LM of ``path``'s config on the meta device in ``dtype``, eval mode: of its
    ``text_config`` alone for a composite (vision-language) checkpoint (:mod:`.composite`)."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(path)
    config = text_config_of(config) or config
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _tied(model) -> dict[str, str]:
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
    if not isinstance(tied, dict) or not getattr(model.config, "tie_word_embeddings", False):
        return {}
    return dict(tied)


def _computed_buffers(model, files: SafetensorsFiles, names: CheckpointNames) -> dict[str, torch.Tensor]:
    """Buffers the checkpoint does not store, under their own name or one ``names`` renames
    (rotary frequencies, Gemma's embedding scale,
    Falcon-H1's µP vector), computed on the CPU the way ``from_pretrained`` does: the missing
    buffers made real, then ``_init_weights`` of their modules and of those modules' ancestors,
    descendants first (``nn.Module.apply``'s order: Falcon-H1 fills its mixers' buffers from the
    model). The parameters stay on the meta device (an embedding table is never allocated for
    this), so whatever ``_init_weights`` does to them is a no-op; an initialiser of a buffer's own
    module that fails on that (one that would read a parameter's values) is refused, naming the
    buffers."""
    owners: dict[str, list[str]] = {}
    modules = dict(model.named_modules())
    for module_name, module in modules.items():
        missing = [b for b, v in module.named_buffers(recurse=False)
                   if v is not None and not _stored(f"{module_name}.{b}".lstrip("."), tuple(v.shape), files, names)]
        if missing:
            owners[module_name] = missing
            for b in missing:
                module._buffers[b] = torch.empty_like(module._buffers[b], device="cpu")
    if not owners:
        return {}
    ancestors = {name for owner in owners for name in modules
                 if name == "" or owner == name or owner.startswith(name + ".")}
    for module_name in reversed(list(modules)):  # descendants before their ancestors
        if module_name not in ancestors:
            continue
        try:
            model._init_weights(modules[module_name])
        except (RuntimeError, NotImplementedError) as err:
            if module_name in owners:
                raise ConfigError(f"{files.path}: buffers {owners[module_name]} of {module_name} are not in the "
                                  f"checkpoint and cannot be computed from the config "
                                  f"({type(err).__name__}: {err})") from None
            # an ancestor's initialiser that reads meta parameters: its buffers' own modules decided
    return {f"{module_name}.{b}".lstrip("."): getattr(modules[module_name], b).detach().clone()
            for module_name, missing in owners.items() for b in missing}


def _stored(name: str, shape: tuple[int, ...], files: SafetensorsFiles, names: CheckpointNames) -> bool:
    return name in files or names.source(name, shape, files) is not None


def model_sources(model, files: SafetensorsFiles) -> dict[str, object]:
    """A source for every parameter and buffer of ``model`` (by its name); raises ConfigError for
    missing, unexpected or mismatched checkpoint tensors, naming them all."""
    block = fp8_block_size(model.config, files.path)  # refuses other quantizations before any lookup
    tied = _tied(model)
    names = CheckpointNames.for_model_type(getattr(model.config, "model_type", None))
    computed = _computed_buffers(model, files, names)
    sources: dict[str, object] = {}
    missing: list[str] = []
    expected = [(n, tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=False)]
    expected += [(n, tuple(b.shape)) for n, b in model.named_buffers(remove_duplicate=False)]
    for name, shape in expected:
        if name in files:
            sources[name] = Stored(files, name)
        elif name in computed:
            sources[name] = InMemory(computed[name], f"{name} (computed from the config)")
        elif name in tied and tied[name] in files:
            sources[name] = Stored(files, tied[name])
        else:
            stored = names.source(name, shape, files)  # renamed, or per-expert tensors merged
            if stored is None:
                missing.append(name)
            else:
                sources[name] = stored
    if missing:
        raise ConfigError(f"{files.path}: the checkpoint has no tensor for {missing} (and no per-expert or tied "
                          f"tensors they are built from); it holds {len(files.names())} tensors")
    sources = dequantized_sources(sources, files, block)
    mismatched = [f"{name}: checkpoint {sources[name].describe()} {tuple(sources[name].shape)}, model {shape}"
                  for name, shape in expected if tuple(sources[name].shape) != shape]
    if mismatched:
        raise ConfigError(f"{files.path}: checkpoint tensors do not fit the config: {mismatched}")
    used = {n for s in sources.values() for n in _stored_names(s)}
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    mtp = mtp_prefixes(model.config)  # read by dcpgraph.speculative.mtp_module for method="mtp"
    unexpected = [n for n in files.names() if n not in used and not any(p.search(n) for p in ignore)
                  and not n.startswith(mtp)]
    if unexpected:
        raise ConfigError(f"{files.path}: checkpoint tensors the model does not have: {unexpected}")
    return sources


def mtp_prefixes(config) -> tuple[str, ...]:
    """``model.layers.{L+i}.`` for the config's ``num_nextn_predict_layers`` MTP layers: tensors
    the causal LM itself does not use (only ``method="mtp"`` reads them)."""
    layers = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    base = getattr(config, "num_hidden_layers", 0)
    return tuple(f"model.layers.{base + i}." for i in range(layers))


def _stored_names(source) -> list[str]:
    if isinstance(source, Stored):
        return [source.name]
    if isinstance(source, (Stacked, Concatenated)):
        return [n for p in source.parts for n in _stored_names(p)]
    if isinstance(source, AbsorbedMLA):
        return _stored_names(source.up)
    if isinstance(source, BlockDequantized):
        return [*_stored_names(source.weight), *_stored_names(source.scale)]
    return []


def state_source(program: Program, target: str, sources: dict[str, object]):
    """The source of state entry ``target``: a pass-derived entry from its inputs' sources
    (:attr:`Program.sources`), else the model's tensor of that name."""
    derived = program.sources.get(target)
    if derived is None:
        if target not in sources:
            raise ConfigError(f"state entry {target!r} has no checkpoint source (not a model parameter or buffer)")
        return sources[target]
    if derived.op in ("mla_absorbed_uk", "mla_absorbed_uv_t"):
        (up,) = derived.inputs
        return AbsorbedMLA(state_source(program, up, sources), derived.op, *derived.args)
    if derived.op == "concat_rows":
        return Concatenated(tuple(state_source(program, t, sources) for t in derived.inputs), 0)
    raise ConfigError(f"state entry {target!r} is derived by {derived.op!r}, which the loader cannot read; "
                      "known: mla_absorbed_uk, mla_absorbed_uv_t, concat_rows")


class ShardedReader:
    """``Program.state_reader``: rank ``r``'s state entries read from the checkpoint by slice,
    the slices of its TP rank (``r mod tp``: every PCP replica holds the same TP shard)."""

    def __init__(self, sources: dict[str, object], checkpoint: str | None = None):
        self.sources = sources
        self.checkpoint = checkpoint  # the model directory (MTP layers are read from it too)

    def __call__(self, program: Program, rank: int) -> list[torch.Tensor]:
        out = []
        tp_rank = program.mesh.tp_rank(rank)
        for spec in program.inputs:
            if spec.kind not in STATE_KINDS:
                continue
            expected = program.state[spec.target]
            source = state_source(program, spec.target, self.sources)
            local = read_local(source, spec.shard, tp_rank, program.mesh.tp).to(expected.dtype).contiguous()
            want = spec.shard.local_shape(tuple(expected.shape), program.mesh.tp)
            if tuple(local.shape) != want:
                raise ConfigError(f"{spec.target}: read {tuple(local.shape)} for rank {rank} (TP rank {tp_rank}), "
                                  f"expected {want}")
            out.append(local)
        return out


def open_checkpoint(path: str, dtype: str):
    """``(meta model, sources)`` of the model directory ``path`` in ``dtype`` (a resolved
    :data:`~.checkpoint.DTYPES` key), checked as :func:`model_sources` says."""
    import transformers as tf

    from .files import DTYPES, weight_files

    files = SafetensorsFiles(path, weight_files(path))
    if text_config_of(tf.AutoConfig.from_pretrained(path)) is not None:
        files = LanguageModelFiles(files)  # the language model's tensors only, under its own names
    model = meta_model(path, DTYPES[dtype])
    return model, model_sources(model, files)


class _NoFiles:
    """The stored tensors of ``load_format="dummy"``: none."""

    def __init__(self, path: str):
        self.path = path

    def __contains__(self, name: str) -> bool:
        return False


def dummy_sources(model, path: str) -> dict[str, object]:
    """``load_format="dummy"``: a :class:`~.tensor_sources.Dummy` for every parameter (a tied one
    shares its target's values) and the config's computed buffers; no weight file is opened."""
    tied = _tied(model)
    sources: dict[str, object] = {n: InMemory(t, f"{n} (computed from the config)")
                                  for n, t in _computed_buffers(model, _NoFiles(path), CheckpointNames((), ())).items()}
    for name, param in model.named_parameters(remove_duplicate=False):
        sources[name] = Dummy(tuple(param.shape), tied.get(name, name))
    return sources


def check_checkpoint(path: str, dtype: str) -> None:
    """Raise ConfigError for missing, unexpected or mismatched tensors; reads headers only."""
    open_checkpoint(path, dtype)


def load_program(path: str, dtype: str, load_format: str = "auto", device: str = "cpu") -> Program:
    """The traced Program of ``path`` with meta state and a :class:`ShardedReader`: compile it
    (``dcpgraph.compile(program, tp=...)``) and each rank's executor reads only its slices.
    ``load_format``: "auto"/"safetensors" (the directory's weight files) or "dummy" (random
    weights, :func:`dummy_sources`: the config alone). ``device``: the device kind the ranks run
    on, which the devices the forward names (``.to(device)``, ``arange(device=...)``) become."""
    from .files import DTYPES
    from .meta_trace import trace_on_meta

    if load_format == "dummy":
        model = meta_model(path, DTYPES[dtype])
        sources = dummy_sources(model, path)
    elif load_format in ("auto", "safetensors"):
        model, sources = open_checkpoint(path, dtype)
    else:
        raise ConfigError(f"load_format must be one of ['auto', 'safetensors', 'dummy'], got {load_format!r}")
    program = trace_on_meta(model, device)
    return program.replace(state_reader=ShardedReader(sources, checkpoint=path))
