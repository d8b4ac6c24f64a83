"""Tiny HF checkpoints on disk, for tests of everything that starts from a model directory.

:func:`save_tiny_checkpoint` writes what ``transformers`` and :class:`dcpgraph.LLM` read from a
real model directory: ``config.json``, safetensors weights (one file, or several with an index
when ``max_shard_size`` is given), ``generation_config.json`` and a fast tokenizer with a ChatML
chat template. Nothing is downloaded.

The tokenizer (:func:`byte_level_tokenizer`) is built with the ``tokenizers`` library: a byte-level
BPE with no merges, so token ``b`` (0–255) is byte ``b`` and every UTF-8 character of more than one
byte spans several tokens (what incremental detokenisation must handle), then three special tokens
and plain filler tokens up to its size. A vocabulary too small for the bytes (GPT-2-like tests of
97 ids) gets :func:`character_tokenizer` instead: printable ASCII characters, then the specials.
The default vocabulary (:data:`DEFAULT_VOCAB`) is divisible by no tp > 1, as real checkpoints'
are not (GPT-2's 50257), so every test of a checkpoint exercises the padded vocab-parallel head.

Weights are random (seeded) and redrawn at a scale where attention and every projection reach the
logits (norm weights N(1, 0.3), biases N(0, 0.3), everything else N(0, 0.2)), so greedy outputs are
varied rather than one repeated token.
"""

from __future__ import annotations

import json
import os

import torch

from ..models import tiny_config
from ..speculative.mtp_module import MTPModule, mtp_config

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DEFAULT_VOCAB = 321  # 256 bytes + 3 specials + 62 fillers; odd, so no tp > 1 divides it
PRINTABLE = "".join(chr(c) for c in range(ord(" "), ord("~") + 1))  # the character tokenizer's alphabet


def first_special_id(tokenizer_vocab_size: int) -> int:
    """The id of :data:`SPECIAL_TOKENS`' first token (BOS and pad; EOS is two further): 256 after
    the bytes, or right after a :func:`character_tokenizer`'s characters."""
    if tokenizer_vocab_size >= 256 + len(SPECIAL_TOKENS):
        return 256
    return tokenizer_vocab_size - len(SPECIAL_TOKENS)


def character_tokenizer(vocab_size: int):
    """A ``PreTrainedTokenizerFast`` of exactly ``vocab_size`` (4–98) tokens: the first
    ``vocab_size - 3`` characters of :data:`PRINTABLE` (space first; other characters are dropped),
    then :data:`SPECIAL_TOKENS`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    characters = vocab_size - len(SPECIAL_TOKENS)
    if not 1 <= characters <= len(PRINTABLE):
        raise ValueError(f"a character tokenizer has 4 to {len(PRINTABLE) + 3} tokens, got {vocab_size}")
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(PRINTABLE[:characters])}, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert tok.get_vocab_size() == vocab_size
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
    )


def tiny_tokenizer(vocab_size: int):
    """:func:`byte_level_tokenizer` where the bytes fit in ``vocab_size``, else :func:`character_tokenizer`."""
    if vocab_size >= 256 + len(SPECIAL_TOKENS):
        return byte_level_tokenizer(vocab_size)
    return character_tokenizer(vocab_size)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (the ByteLevel pre-tokenizer's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def byte_level_tokenizer(vocab_size: int = DEFAULT_VOCAB):
    """A ``PreTrainedTokenizerFast`` of exactly ``vocab_size`` tokens: ids 0–255 are the bytes,
    256–258 are :data:`SPECIAL_TOKENS` (``<|im_end|>`` is EOS), the rest are fillers ``<|wN|>``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fillers = vocab_size - 256 - len(SPECIAL_TOKENS)
    tok.add_tokens([AddedToken(f"<|w{k}|>", special=False, normalized=False) for k in range(fillers)])
    assert tok.get_vocab_size() == vocab_size
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
    )


def tiny_model(arch: str, *, vocab_size: int = DEFAULT_VOCAB, layers: int = 2, seed: int = 0,
               dtype: torch.dtype = torch.float32, tokenizer_vocab_size: int | None = None):
    """A random-weight HF causal LM of :func:`dcpgraph.models.tiny_config`'s shapes, with the
    special ids of :func:`tiny_tokenizer` of ``tokenizer_vocab_size`` (default: ``vocab_size``)
    in its config and weights redrawn as the module docstring says."""
    import transformers as tf


    config = tiny_config(arch, layers=layers, vocab=vocab_size)
    special = first_special_id(tokenizer_vocab_size or vocab_size)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = special, special + 2, special
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            mean, std = (1.0, 0.3) if "norm" in name else (0.0, 0.3) if name.endswith("bias") else (0.0, 0.2)
            p.copy_(mean + std * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    model.generation_config.eos_token_id = special + 2
    model.generation_config.bos_token_id = special
    model.generation_config.pad_token_id = special
    return model.to(dtype)


def save_tiny_checkpoint(path: str | os.PathLike, arch: str = "qwen3", *, vocab_size: int = DEFAULT_VOCAB,
                         layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.float32,
                         max_shard_size: str | None = None, tokenizer_vocab_size: int | None = None,
                         mtp_weights: bool = False) -> str:
    """Write a model directory for ``arch`` (llama, qwen2, qwen3, deepseek_v2, deepseek_v3) to
    ``path``; returns ``path``. ``max_shard_size`` (e.g. ``"40KB"``) writes a sharded checkpoint
    with ``model.safetensors.index.json``; ``tokenizer_vocab_size`` (default: the model's) lets a
    test write a tokenizer larger than the model; ``mtp_weights`` (deepseek_v3) adds the
    ``num_nextn_predict_layers`` MTP layers' tensors (:func:`add_mtp_weights`)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    model = tiny_model(arch, vocab_size=vocab_size, layers=layers, seed=seed, dtype=dtype,
                       tokenizer_vocab_size=tokenizer_vocab_size)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    tiny_tokenizer(tokenizer_vocab_size or vocab_size).save_pretrained(path)
    if mtp_weights:
        add_mtp_weights(path, seed=seed + 1, dtype=dtype)
    return path


def add_mtp_weights(path: str, *, seed: int = 1, dtype: torch.dtype = torch.float32, own_head: bool = True) -> None:
    """Append random MTP layers (``model.layers.{L+i}.*``: enorm, hnorm, eh_proj, a decoder
    layer, shared_head) to the single-file checkpoint at ``path``, drawn like the model's weights;
    ``own_head=False`` leaves out ``shared_head.head`` (the target's LM head is then used)."""
    import transformers as tf
    from safetensors.torch import load_file, save_file


    config = tf.AutoConfig.from_pretrained(path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    for i in range(int(getattr(config, "num_nextn_predict_layers", 0) or 0)):
        index = config.num_hidden_layers + i
        module = MTPModule(mtp_config(config, "sdpa"), index, own_head)
        prefix = f"model.layers.{index}."
        for name, p in module.named_parameters():
            if not name.startswith(prefix):
                continue  # embed_tokens / lm_head are the target's
            mean, std = (1.0, 0.3) if "norm" in name else (0.0, 0.2)
            value = (mean + std * torch.randn(p.shape, generator=gen, dtype=torch.float64)).to(dtype)
            weights.update(_per_expert(name, value))
        for name, b in module.named_buffers():
            if name.startswith(prefix):
                weights[name] = b.to(dtype) if b.is_floating_point() else b
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def _per_expert(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """A fused expert parameter as the per-expert tensors DeepSeek checkpoints store
    (``gate_up_proj[e] = cat(gate_proj, up_proj)``, ``down_proj[e]``); other tensors as they are."""
    prefix, _, param = name.rpartition(".")
    if not prefix.endswith(".experts") or param not in ("gate_up_proj", "down_proj"):
        return {name: value}
    out = {}
    for e in range(value.shape[0]):
        if param == "down_proj":
            out[f"{prefix}.{e}.down_proj.weight"] = value[e].contiguous()
        else:
            gate, up = value[e].chunk(2, 0)
            out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
            out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
    return out


def _num_layers(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return int(json.load(f)["num_hidden_layers"])


def make_mtp_predictable(path: str, eps: float, hidden_part: float = 0.0, mtp_attention: float | None = None) -> None:
    """Rewrite the checkpoint so the target is (for ``eps = 0``) exactly a bigram model
    ``next(x) = argmax(lm_head · ê_x)`` (``ê`` the RMS-normalised embedding: every attention and
    MLP output scaled by ``eps``, unit norm weights) and the MTP layer computes the same function
    of its input token (``eh_proj = [I, 0]``, unit norms, the target's head, its own attention and
    MLP outputs scaled by ``eps``): it then predicts the target's next token exactly. With
    ``0 < eps`` both depend a little on context (attention over their KV caches), so drafts are
    mostly, not always, accepted."""
    from safetensors.torch import load_file, save_file

    weights = load_file(f"{path}/model.safetensors")
    hidden = weights["model.embed_tokens.weight"].shape[1]
    mtp_layer = f"model.layers.{_num_layers(path)}."
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            mtp_o_proj = name.startswith(mtp_layer) and name.endswith("o_proj.weight")
            weights[name] = weights[name] * (mtp_attention if mtp_o_proj and mtp_attention is not None else eps)
        if name == "model.norm.weight" or name.endswith(("enorm.weight", "hnorm.weight", "shared_head.norm.weight")):
            weights[name] = torch.ones_like(weights[name])
        if name.endswith("eh_proj.weight"):
            eye = torch.eye(hidden, dtype=weights[name].dtype)
            weights[name] = torch.cat([eye, hidden_part * weights[name][:, hidden:]], 1)
        if name.endswith("shared_head.head.weight"):
            weights[name] = weights["lm_head.weight"].clone()
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})


def quantize_checkpoint_fp8(path: str, block: tuple[int, int] = (128, 128)) -> list[str]:
    """Rewrite the single-file checkpoint at ``path`` in DeepSeek-V3's fp8 format: every 2-D
    attention and MLP projection weight (not norms, not the MoE router, not the embedding or LM
    head) becomes ``float8_e4m3fn`` with ``<name>_scale_inv``, one fp32 scale ``amax / 448`` per
    ``block`` tile (partial tiles at the edges), and config.json gains the matching
    ``quantization_config``. Returns the quantized names."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    rows, cols = block
    quantized = []
    for name in sorted(tensors):
        value = tensors[name]
        module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if not (value.dim() == 2 and "proj" in module and (".self_attn." in name or ".mlp." in name)):
            continue
        w = value.to(torch.float32)
        scale = torch.empty(-(-w.shape[0] // rows), -(-w.shape[1] // cols))
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                tile = w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
                s = max(float(tile.abs().max()) / 448.0, 1e-12)
                scale[i, j] = s
                q[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = (tile / s).to(torch.float8_e4m3fn)
        tensors[name], tensors[name + "_scale_inv"] = q, scale
        quantized.append(name)
    save_file(tensors, file, metadata={"format": "pt"})
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [rows, cols]}
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2)
    return quantized
