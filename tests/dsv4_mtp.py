"""A tiny DeepSeek-V4 checkpoint with an MTP layer, and the MTP tests' dense reference
(``tests/test_mtp_v4.py``).

The checkpoint is written by transformers itself: a 5-layer model of ``tests/dsv4_models.py`` (the
fifth layer sliding-window attention with a learned router, the block type of V4's MTP layer) is
saved with ``save_pretrained``, which stores it under the released checkpoint's names; its fifth
layer's tensors are then moved to ``mtp.0.*``, the MTP's own tensors (``e_proj``, ``h_proj``,
``enorm``, ``hnorm``, ``norm``, ``hc_head_fn/base/scale``) added under the released names, and
``config.json`` cut to the 4 target layers with ``num_nextn_predict_layers = 1``. transformers
loads the target and ignores ``mtp.*``.

The reference keeps the fifth layer as HF's ``DeepseekV4DecoderLayer`` in memory and writes the
rest of the MTP formula by hand (DeepSeek's ``MTPBlock``): a dense forward over the whole context
with an explicit sliding-window causal mask, no cache, fed the target's hyper-connection streams
(the input of HF's ``hc_head``, captured by a hook on a full forward).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import dsv4_models
import torch

MTP_TYPES = (*dsv4_models.LAYER_TYPES, "sliding_attention")
MLP_TYPES = ("hash_moe", "hash_moe", "moe", "moe", "moe")


@dataclass
class Reference:
    """The MTP layer of a saved checkpoint, held in memory for the dense reference."""

    block: torch.nn.Module  # HF's DeepseekV4DecoderLayer (eager attention)
    own: dict[str, torch.Tensor]  # e_proj, h_proj, enorm, hnorm, norm, hc_head_fn, hc_head_base, hc_head_scale
    embed: torch.Tensor
    head: torch.Tensor
    rotary: torch.nn.Module
    config: object


def save_checkpoint(path: str, *, eps: float | None = None, hidden_part: float = 0.3, mtp_attention: float = 0.3,
                    seed: int = 3) -> Reference:
    """Write the checkpoint to ``path``; returns the reference of its MTP layer. ``eps`` (None:
    random weights as drawn) makes both target and MTP nearly a bigram model of their input token
    (every attention and MoE output of the target scaled by ``eps``, unit final norms; the MTP's
    ``e_proj = I``, ``h_proj`` scaled by ``hidden_part``, its attention output by
    ``mtp_attention``, its MoE output by ``eps``), so MTP drafts are mostly, not always, accepted."""
    from safetensors.torch import load_file, save_file

    from dcpgraph.testing.checkpoints import tiny_tokenizer

    big = dsv4_models.build(seed=seed, o_groups=4, num_hidden_layers=len(MTP_TYPES), layer_types=list(MTP_TYPES),
                            mlp_layer_types=list(MLP_TYPES))
    hidden, n = big.config.hidden_size, big.config.hc_mult
    gen = torch.Generator().manual_seed(seed + 1)

    def draw(shape, mean=0.0, std=0.2):
        return mean + std * torch.randn(shape, generator=gen, dtype=torch.float64)

    own = {"e_proj": draw((hidden, hidden)), "h_proj": draw((hidden, hidden)), "enorm": draw(hidden, 1.0, 0.3),
           "hnorm": draw(hidden, 1.0, 0.3), "norm": draw(hidden, 1.0, 0.3), "hc_head_fn": draw((n, n * hidden)),
           "hc_head_base": draw(n), "hc_head_scale": draw(1, 1.0, 0.3)}
    mtp = len(MTP_TYPES) - 1
    if eps is not None:
        with torch.no_grad():
            for name, p in big.named_parameters():
                in_mtp = name.startswith(f"model.layers.{mtp}.")
                if name.endswith("o_b_proj.weight"):
                    p.mul_(mtp_attention if in_mtp else eps)
                elif name.endswith(("experts.down_proj", "shared_experts.down_proj.weight")):
                    p.mul_(eps)
            big.model.norm.weight.fill_(1.0)
        own.update(e_proj=torch.eye(hidden, dtype=torch.float64), h_proj=hidden_part * own["h_proj"],
                   enorm=torch.ones(hidden, dtype=torch.float64), hnorm=torch.ones(hidden, dtype=torch.float64),
                   norm=torch.ones(hidden, dtype=torch.float64))
    big.save_pretrained(path)
    tiny_tokenizer(96).save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    stored = {}
    for name, value in weights.items():
        prefix = f"model.layers.{mtp}."
        stored[f"mtp.0.{name[len(prefix):]}" if name.startswith(prefix) else name] = value
    stored.update({f"mtp.0.{k}.weight" if k in ("e_proj", "h_proj", "enorm", "hnorm", "norm") else f"mtp.0.{k}": v
                   for k, v in own.items()})
    save_file(stored, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(num_hidden_layers=mtp, layer_types=list(MTP_TYPES[:mtp]), mlp_layer_types=list(MLP_TYPES[:mtp]),
                  num_nextn_predict_layers=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return Reference(big.model.layers[mtp], own, big.model.embed_tokens.weight.detach(),
                     big.lm_head.weight.detach(), big.model.rotary_emb, big.config)


def target_streams(target, tokens: list[int]) -> torch.Tensor:
    """``[T, n·D]``: the target's hyper-connection streams after its last decoder layer (the
    input of HF's ``hc_head``) for every position of ``tokens``, from one full forward."""
    from dcpgraph.testing.generation import hf_reference

    seen = []
    hook = target.model.hc_head.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        with torch.no_grad(), hf_reference(target):
            target(input_ids=torch.tensor([tokens]), use_cache=False)
    finally:
        hook.remove()
    return seen[0][0].flatten(1)


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """HF V4's RMSNorm: normalised in fp32, then the weight."""
    y = x.to(torch.float32)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) if weight is None else (weight * y).to(x.dtype)


def dense_mtp(ref: Reference, ids: list[int], streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP layer over positions ``0 .. T-1`` at once: ids ``[T]`` (token ``t + 1`` at position
    ``t``), streams ``[T, n·D]`` → (logits ``[T, V]``, output streams ``[T, n·D]``)."""
    cfg = ref.config
    n, hidden, eps = cfg.hc_mult, cfg.hidden_size, cfg.rms_norm_eps
    t = len(ids)
    ids_t, pos = torch.tensor(ids), torch.arange(t)
    s = streams.view(t, n, hidden)
    e = _rms(ref.embed[ids_t], ref.own["enorm"], eps) @ ref.own["e_proj"].T
    x = _rms(s, ref.own["hnorm"], eps) @ ref.own["h_proj"].T + e[:, None]
    rope = {kind: ref.rotary(x, position_ids=pos[None], layer_type=kind) for kind in ("main", "compress")}
    visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - cfg.sliding_window)
    mask = torch.zeros(t, t, dtype=x.dtype).masked_fill(~visible, float("-inf"))[None, None]
    with torch.no_grad():
        x = ref.block(x[None], input_ids=ids_t[None], position_embeddings=rope, position_ids=pos[None],
                      attention_mask=mask)[0]  # [T, n, D]
        flat = x.flatten(1)
        mixes = _rms(flat.float(), None, eps) @ ref.own["hc_head_fn"].float().T
        pre = torch.sigmoid(mixes * ref.own["hc_head_scale"].float() + ref.own["hc_head_base"].float()) + cfg.hc_eps
        collapsed = (pre[..., None] * x).sum(1).to(x.dtype)
        logits = _rms(collapsed, ref.own["norm"], eps) @ ref.head.T
    return logits, flat


def dense_drafts(target, ref: Reference, tokens: list[int], s: int, drafts: list[int]) -> torch.Tensor:
    """The MTP's logits ``[k, V]`` for the ``k = len(drafts)`` drafts after ``tokens[: s + 1]``:
    positions ``t < s`` read ``(tokens[t+1], S_t)`` with ``S`` the target's streams; each further
    step the previous draft (``drafts[j - 1]``, whatever chose it) and the MTP's own output streams
    at the last position. Every step recomputes the whole context densely."""
    streams = target_streams(target, tokens[: s + 1])
    ids, rows, out = list(tokens[1: s + 1]), list(streams[:s]), []
    for draft in drafts:
        logits, states = dense_mtp(ref, ids, torch.stack(rows))
        out.append(logits[-1])
        ids.append(draft)
        rows.append(states[-1])
    return torch.stack(out)
