"""A local HF model directory: checked up front, then loaded on whichever process needs it.

:func:`inspect_checkpoint` reads only small files (``config.json``, the safetensors index and the
tokenizer) and raises before any rank starts for: a path that is not a model directory, a config
naming an architecture transformers has no causal LM for, missing weight files (``.bin``-only
checkpoints included), a tokenizer with more tokens than the model's vocabulary, an unknown
``dtype``, a ``(tp, dcp)`` mesh the model's heads cannot take (:meth:`Mesh.validate`), and
checkpoint tensors that are missing, unexpected or of the wrong shape (safetensors headers against
the model built on the meta device: :func:`~.loader.check_checkpoint`).

Engines load with :func:`~.loader.load_program` (each rank reads only its slices).
:func:`load_model` loads the whole model with ``from_pretrained`` on one process (the HF reference
tests compare against), refusing missing, unexpected or mismatched tensors as well.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from ..errors import ConfigError, UnsupportedModelError
from ..frontends.layer_shapes import config_per_layer, differing
from ..mesh import Mesh
from .composite import require_text_causal_lm, text_config_of
from .files import DTYPES, weight_files  # noqa: F401 - DTYPES is re-exported


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    architecture: str
    dtype: str  # a key of DTYPES other than "auto"
    vocab_size: int
    max_position_embeddings: int | None
    eos_token_ids: tuple[int, ...]
    weight_files: tuple[str, ...]


def resolve_dtype(name: str, config) -> str:
    if name not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    if name != "auto":
        return name
    configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(configured, str):
        configured = getattr(torch, configured)
    return str(configured).removeprefix("torch.")


def _eos_ids(path: str, config) -> tuple[int, ...]:
    eos = None
    if os.path.exists(os.path.join(path, "generation_config.json")):
        with open(os.path.join(path, "generation_config.json")) as f:
            eos = json.load(f).get("eos_token_id")
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def require_model_dir(path: str) -> None:
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
        raise ConfigError(f"model must be a local HF model directory with a config.json, got {path!r}")


def inspect_checkpoint(path: str, *, dtype: str = "auto", tp: int = 1, dcp: int = 1, block_size: int = 16,
                       interleave: int = 1, tokenizer=None, load_format: str = "auto", pcp: int = 1) -> CheckpointInfo:
    """Check ``path`` (and ``tokenizer``, if given) as the module docstring says; cheap, no weights.
    ``load_format="dummy"``: the config alone (no weight file is looked for)."""
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    require_model_dir(path)
    try:
        config = tf.AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as err:
        raise UnsupportedModelError(f"{path}/config.json: {err}") from None
    known = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    architectures = list(getattr(config, "architectures", None) or [])
    usable = [a for a in architectures if a in known]
    composite_text = text_config_of(config)
    if composite_text is not None:  # a vision-language checkpoint: its language model is served
        usable = [require_text_causal_lm(composite_text, path)]
    if not usable:
        raise UnsupportedModelError(
            f"{path}: config.architectures={architectures} names no causal LM transformers knows "
            f"(e.g. {', '.join(sorted(known & {'LlamaForCausalLM', 'Qwen3ForCausalLM', 'DeepseekV2ForCausalLM'}))})")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    per_layer = getattr(text, "per_layer_attributes", None) or set()
    mla = "kv_lora_rank" in per_layer or getattr(text, "kv_lora_rank", None) is not None
    layer_kv = () if mla else differing(config_per_layer(text, "num_key_value_heads") or ())
    kv_heads = 1 if mla else (layer_kv[0] if layer_kv else getattr(text, "num_key_value_heads", None) or heads)
    Mesh(tp, dcp, pcp).validate(attention="mla" if mla else "gqa", num_q_heads=heads, num_kv_heads=kv_heads,
                                block_size=block_size, interleave=interleave, layer_kv_heads=layer_kv)
    if tokenizer is not None and len(tokenizer) > text.vocab_size:
        raise ConfigError(f"{path}: the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
                          f"{text.vocab_size}; ids past it would index outside the embedding")
    from .loader import check_checkpoint

    resolved = resolve_dtype(dtype, config)
    files = ()
    if load_format != "dummy":
        files = weight_files(path)
        check_checkpoint(path, resolved)
    return CheckpointInfo(
        path=path, architecture=usable[0], dtype=resolved, vocab_size=text.vocab_size,
        max_position_embeddings=getattr(text, "max_position_embeddings", None),
        eos_token_ids=_eos_ids(path, config), weight_files=files,
    )


def load_model(path: str, dtype: str) -> torch.nn.Module:
    """The model of ``path`` in ``dtype`` (eval mode), refusing missing/unexpected/mismatched tensors."""
    import transformers as tf

    try:
        model, info = tf.AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], output_loading_info=True)
    except RuntimeError as err:  # transformers raises on shape mismatches
        raise ConfigError(f"{path}: weights do not fit the config: {err}") from None
    problems = {k: sorted(v) for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:
        raise ConfigError(f"{path}: checkpoint tensors do not match the model: {problems}")
    if DTYPES[dtype] == torch.float64 and getattr(model.config, "_experts_implementation", None) == "grouped_mm":
        model.set_experts_implementation("eager")  # grouped_mm has no fp64 kernel
    return model.eval()


def load_tokenizer(path: str, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise ConfigError(f"model (or tokenizer) must be a local directory, got {path!r}")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: cannot load a tokenizer: {err}") from None
