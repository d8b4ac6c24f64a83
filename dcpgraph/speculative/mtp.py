"""``method="mtp"``: DeepSeek-V3's and V4's multi-token-prediction layers — the checks.

A DeepSeek-V3 checkpoint with ``num_nextn_predict_layers = n`` stores, after its
``num_hidden_layers = L`` decoder layers, ``n`` extra layers ``model.layers.{L+i}.*``: ``enorm``
(embedding norm), ``hnorm`` (hidden-state norm), ``eh_proj`` (projection of their concatenation),
one decoder layer and ``shared_head`` (final norm and head); a DeepSeek-V4 checkpoint stores them
as ``mtp.{i}.*`` (:mod:`.mtp_v4_module`). HF transformers' ``deepseek_v3`` (and ``deepseek_v4``)
drops those weights when loading, so an ``nn.Module`` or a traced Program never has them: MTP
needs the target given as a checkpoint (a directory for ``LLM``, or a Program from
:func:`dcpgraph.checkpoints.loader.load_program` for ``compile``).

:func:`check_mtp` refuses the method before any work, naming the reason — a model without MTP
layers, a target that is not a checkpoint, or a checkpoint whose files lack the weights — and the
methods that work. The layer itself is :mod:`.mtp_module`, the drafting :mod:`.mtp_proposer`.
"""

from __future__ import annotations

from ..checkpoints.files import weight_files
from ..checkpoints.tensor_sources import SafetensorsFiles
from ..errors import ConfigError

ALTERNATIVES = "use method 'ngram' or 'draft_model'"


def mtp_weight_prefixes(names, num_hidden_layers: int, layers: int) -> list[str]:
    """The prefixes among ``names`` that carry an MTP layer: DeepSeek-V3's
    ``model.layers.{L+i}.`` with ``eh_proj.weight``, or DeepSeek-V4's ``mtp.{i}.`` (or
    ``model.mtp.{i}.``) with ``e_proj.weight`` (the tensors only an MTP layer has)."""
    present = set(names)
    found = []
    for i in range(layers):
        v3 = f"model.layers.{num_hidden_layers + i}."
        v4 = [p for p in (f"mtp.{i}.", f"model.mtp.{i}.") if f"{p}e_proj.weight" in present]
        found += [v3] if f"{v3}eh_proj.weight" in present else v4[:1]
    return found


def check_mtp(facts, weight_names=None, num_hidden_layers: int | None = None) -> None:
    """Refuse ``method="mtp"`` with the reason, or return when it can run. ``weight_names``: the
    checkpoint's tensor names (a model directory); ``None`` for an ``nn.Module`` or a Program
    not loaded from a checkpoint, which cannot hold them."""
    layers = int(facts.extra.get("num_nextn_predict_layers") or 0)
    if layers <= 0:
        raise ConfigError(f"speculative method 'mtp' needs a checkpoint with multi-token-prediction layers "
                          f"(num_nextn_predict_layers > 0); {facts.architecture} has none: {ALTERNATIVES}")
    if weight_names is None:
        raise ConfigError(f"speculative method 'mtp' reads the MTP layers' weights from a checkpoint directory; "
                          f"a {facts.architecture} module or traced Program has none (transformers drops them): "
                          f"give the checkpoint (LLM(model=DIR), or compile(load_program(DIR, dtype))), or "
                          f"{ALTERNATIVES}")
    found = mtp_weight_prefixes(weight_names, num_hidden_layers or facts.num_layers, layers)
    if len(found) < layers:
        raise ConfigError(f"the checkpoint declares num_nextn_predict_layers={layers} but holds MTP weights "
                          f"for {len(found)} layer(s) (no model.layers.N.eh_proj.weight, nor DeepSeek-V4's "
                          f"mtp.I.e_proj.weight): {ALTERNATIVES}")
    if facts.attention != "mla" and not all("mtp." in p for p in found):
        raise ConfigError(f"speculative method 'mtp' runs DeepSeek-V3-style MTP layers (MLA attention) and "
                          f"DeepSeek-V4's (mtp.I.*); "
                          f"{facts.architecture} has {facts.attention} attention: {ALTERNATIVES}")


def checkpoint_of(model) -> str | None:
    """The model directory a Program was loaded from (:func:`~dcpgraph.checkpoints.loader.load_program`),
    or ``None`` (an ``nn.Module``, a traced Program)."""
    return getattr(getattr(model, "state_reader", None), "checkpoint", None)


def check_mtp_target(facts, model) -> str:
    """:func:`check_mtp` for the target ``compile`` was given; returns its checkpoint directory."""
    path = checkpoint_of(model)
    names = num_hidden = None
    if path is not None:
        import transformers as tf

        names = SafetensorsFiles(path, weight_files(path)).names()
        num_hidden = tf.AutoConfig.from_pretrained(path).num_hidden_layers
    check_mtp(facts, names, num_hidden)
    from .mtp_module import check_mtp_weights

    check_mtp_weights(path)
    return path
