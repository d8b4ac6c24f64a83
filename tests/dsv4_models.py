"""Tiny seeded DeepSeek-V4 models for the compressed-attention tests (``test_compressed_*``).

Four layers cover every attention kind V4 ships: sliding-only, two heavily compressed (HCA, rate
``HCA_RATE``, non-overlapping windows) and one compressed sparse (CSA, rate ``CSA_RATE``,
overlapping windows, lightning indexer keeping ``TOPK`` entries). The window ``WINDOW`` is shorter
than the test prompts and ``TOPK`` is smaller than the number of entries a prompt emits, so the
window, the compressed entries and the selection all decide what later queries see. Layers 0-1
route by token hash, 2-3 by a learned top-k router (both MoE kinds); ``hc_mult`` 2 streams. The
vocabulary (``VOCAB`` = 131) divides by no tp > 1, as real checkpoints' often do not, so a
vocab-parallel embedding or LM head is padded.

fp64 weights redrawn from N(0, 0.2) (norms N(1, 0.3), position biases and sinks N(0, 0.5)) so
attention, gates and the indexer are far from uniform; the hash table ``tid2eid`` is drawn at
random (HF initialises it to zeros, which would send every token to expert 0).

Ties: an indexer score is exactly 0 when every head's ReLU is 0; torch's ``topk`` orders such
ties arbitrarily, dcpgraph by position. With ``INDEX_HEADS`` = 8 that has probability about 2⁻⁸ per
(query, entry); the comparisons with HF are exact on these seeds (a flip would fail them).
"""

from __future__ import annotations

import torch
import transformers

VOCAB = 131
HEADS, HEAD_DIM, ROPE_DIM = 4, 32, 8
WINDOW = 6
CSA_RATE, HCA_RATE = 2, 4
INDEX_HEADS, INDEX_DIM, TOPK = 8, 16, 3
LAYER_TYPES = ("sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention",
               "heavily_compressed_attention")
PROMPTS = ((7,), (9, 4, 77), tuple((5 * i + 1) % VOCAB for i in range(11)),
           tuple((7 * i + 3) % VOCAB for i in range(23)))


def config(**overrides) -> transformers.DeepseekV4Config:
    fields = dict(
        vocab_size=VOCAB, hidden_size=48, moe_intermediate_size=32, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=HEADS, num_key_value_heads=1, head_dim=HEAD_DIM, q_lora_rank=24,
        partial_rotary_factor=ROPE_DIM / HEAD_DIM, num_experts_per_tok=2, n_routed_experts=4,
        n_shared_experts=1, layer_types=list(LAYER_TYPES), mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 2,
        compress_rates={"compressed_sparse_attention": CSA_RATE, "heavily_compressed_attention": HCA_RATE},
        hc_mult=2, hc_sinkhorn_iters=4, sliding_window=WINDOW, o_groups=2, o_lora_rank=16,
        index_n_heads=INDEX_HEADS, index_head_dim=INDEX_DIM, index_topk=TOPK, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None,
    )
    fields.update(overrides)
    return transformers.DeepseekV4Config(**fields)


def build(*, seed: int = 1, **config_overrides) -> torch.nn.Module:
    """The seeded fp64 model, with eager experts so HF's own ``generate`` is the reference."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(**config_overrides))
    model = model.to(torch.float64).eval()
    model.set_experts_implementation("eager")
    model.generation_config.eos_token_id = None  # greedy runs its full length; no token ends it early
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("layernorm.weight"):
                mean, std = 1.0, 0.3
            elif pname.endswith(("position_bias", "sinks")):
                mean, std = 0.0, 0.5
            else:
                mean, std = 0.0, 0.2
            p.copy_(mean + std * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        for bname, b in model.named_buffers():
            if bname.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                rows = [torch.randperm(experts, generator=gen)[: b.shape[1]] for _ in range(b.shape[0])]
                b.copy_(torch.stack(rows))
            elif bname.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen, dtype=b.dtype))
    return model


def hf_greedy(model, prompt, max_new_tokens: int) -> list[int]:
    """HF's own greedy ``generate`` (with its V4 cache) → the generated token ids."""
    ids = torch.tensor([list(prompt)])
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


class ShardedV4Runner:
    """Runs the HF model with each attention layer's cache held by dcpgraph: the raw window and the
    compressed entries (plus indexer keys) in a :class:`ShardedCompressedCache` over ``dcp``
    emulated ranks, the compressors' open windows in :class:`OpenWindow` states. Projections,
    norms, rotary, hyper-connections and MoE are HF's own modules on the same weights; the
    attention itself, the compressor stream, the sharded top-k and the LSE merge are dcpgraph's.
    With ``tp > dcp`` each DCP group holds its own copy and attends for its ranks' heads
    (:func:`dcp_group_heads`). Tokens go in steps of any size (chunked prefill, then one token per
    decode step)."""

    def __init__(self, model, *, tp: int = 1, dcp: int = 1, interleave: int = 1):
        from dcpgraph.ops.compressed_attention import ShardedCompressedCache, dcp_group_heads
        from dcpgraph.ops.compressor import open_window

        self.model, cfg = model, model.config
        self.groups = dcp_group_heads(cfg.num_attention_heads, tp, dcp)
        self.caches, self.states = {}, {}
        dtype = next(model.parameters()).dtype
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            kind = cfg.layer_types[i]
            csa = kind == "compressed_sparse_attention"
            rate = cfg.compress_rates.get(kind, 1)
            self.caches[i] = [  # one copy of the layer's cache per DCP group, each sharded over dcp ranks
                ShardedCompressedCache(dcp=dcp, window=cfg.sliding_window, rate=rate, head_dim=cfg.head_dim,
                                       index_dim=cfg.index_head_dim if csa else 0, interleave=interleave,
                                       dtype=dtype)
                for _ in self.groups]
            if attn.compressor is not None:
                width = (2 if csa else 1) * cfg.head_dim
                self.states[(i, "compressor")] = open_window(width, dtype=dtype)
                if csa:
                    self.states[(i, "indexer")] = open_window(2 * cfg.index_head_dim, dtype=dtype)
        self.position = 0

    def step(self, ids) -> torch.Tensor:
        """Feed the next tokens ``ids``; return the last position's logits."""
        from unittest import mock

        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

        runner = self

        def forward(attn, hidden_states, position_embeddings, position_ids, attention_mask=None, **_):
            return runner._attention(attn, hf, hidden_states, position_embeddings, position_ids)

        ids = torch.tensor([list(ids)])
        positions = torch.arange(self.position, self.position + ids.shape[1]).unsqueeze(0)
        with mock.patch.object(hf.DeepseekV4Attention, "forward", forward), torch.no_grad():
            logits = self.model(input_ids=ids, position_ids=positions, use_cache=False).logits
        self.position += ids.shape[1]
        return logits[0, -1]

    def _compress(self, hf, module, key, hidden, rate, overlap):
        from dcpgraph.ops.compressor import compress_stream

        state = self.states[key]
        pooled, self.states[key] = compress_stream(state, module.kv_proj(hidden)[0], module.gate_proj(hidden)[0],
                                                   module.position_bias, rate=rate, overlap=overlap)
        entries = module.kv_norm(pooled).unsqueeze(0)
        where = (state.entries + torch.arange(entries.shape[1])) * rate
        cos, sin = module.rotary_emb(entries, position_ids=where.unsqueeze(0), layer_type="compress")
        return state.entries, hf.apply_rotary_pos_emb(entries.unsqueeze(1), cos, sin)[0, 0]

    def _attention(self, attn, hf, hidden, position_embeddings, position_ids):
        batch, seq, _ = hidden.shape
        cos, sin = position_embeddings[attn.rope_layer_type]
        q_residual = attn.q_a_norm(attn.q_a_proj(hidden))
        q = attn.q_b_norm(attn.q_b_proj(q_residual).view(batch, seq, -1, attn.head_dim).transpose(1, 2))
        q = hf.apply_rotary_pos_emb(q, cos, sin)
        kv = attn.kv_norm(attn.kv_proj(hidden)).view(batch, seq, 1, attn.head_dim).transpose(1, 2)
        kv = hf.apply_rotary_pos_emb(kv, cos, sin)
        caches, positions = self.caches[attn.layer_idx], position_ids[0]
        selected = [None] * len(caches)
        for cache in caches:
            cache.append_tokens(positions, kv[0, 0])
        comp, rate = attn.compressor, caches[0].rate
        if comp is not None:
            overlap = attn.layer_type == "compressed_sparse_attention"
            first, entries = self._compress(hf, comp, (attn.layer_idx, "compressor"), hidden, rate, overlap)
            keys = None
            if overlap:
                ix = comp.indexer
                _, keys = self._compress(hf, ix, (attn.layer_idx, "indexer"), hidden, rate, True)
                cos_i, sin_i = ix.rotary_emb(hidden, position_ids=position_ids, layer_type="compress")
                iq = ix.q_b_proj(q_residual).view(batch, seq, -1, ix.head_dim).transpose(1, 2)
                iq = hf.apply_rotary_pos_emb(iq, cos_i, sin_i)[0].transpose(0, 1)
                weights = ix.scorer.weights_proj(hidden).float()[0] * ix.scorer.weights_scaling
            for g, cache in enumerate(caches):
                cache.append_entries(first, entries, keys)
                if overlap:
                    selected[g] = cache.select(iq, weights, positions, topk=ix.index_topk,
                                               scale=ix.scorer.softmax_scale)
        q = q[0].transpose(0, 1)
        out = torch.cat([
            cache.attend(q[:, heads.start:heads.stop], positions, attn.sinks[heads.start:heads.stop],
                         scale=attn.scaling, selected=chosen)
            for heads, cache, chosen in zip(self.groups, caches, selected)], dim=1)
        for cache in caches:
            cache.drop_unreachable(int(positions[-1]) + 1)
        out = hf.apply_rotary_pos_emb(out.unsqueeze(0).transpose(1, 2), cos, -sin).transpose(1, 2)
        grouped = attn.o_a_proj(out.reshape(batch, seq, attn.config.o_groups, -1)).flatten(2)
        return attn.o_b_proj(grouped), None


def sharded_greedy(model, prompt, max_new_tokens: int, *, chunk: int, tp: int = 1, dcp: int = 1,
                   interleave: int = 1) -> list[int]:
    """Greedy tokens from :class:`ShardedV4Runner`: the prompt in steps of ``chunk`` tokens, then
    one token per step."""
    runner = ShardedV4Runner(model, tp=tp, dcp=dcp, interleave=interleave)
    prompt = list(prompt)
    for start in range(0, len(prompt), chunk):
        logits = runner.step(prompt[start:start + chunk])
    out = []
    for _ in range(max_new_tokens):
        out.append(int(logits.argmax()))
        logits = runner.step([out[-1]])
    return out


_TRACED: dict = {}


def traced(**config_overrides):
    """``(model, dcpgraph.trace(model))`` of :func:`build`, traced once per process and overrides
    (the V4 export takes 20-70 s here; test modules share it)."""
    import dcpgraph

    key = tuple(sorted(config_overrides.items()))
    if key not in _TRACED:
        model = build(**config_overrides)
        _TRACED[key] = (model, dcpgraph.trace(model))
    return _TRACED[key]


def chunk_steps(lengths, cuts):
    """Per step: ``[(request, start, end)]`` of each request's next chunk (cut sizes cycle)."""
    done, steps, i = [0] * len(lengths), [], 0
    while any(d < n for d, n in zip(done, lengths)):
        step = []
        for r, n in enumerate(lengths):
            if done[r] < n:
                size = min(cuts[(i + r) % len(cuts)], n - done[r])
                step.append((r, done[r], done[r] + size))
                done[r] += size
        steps.append(step)
        i += 1
    return steps
