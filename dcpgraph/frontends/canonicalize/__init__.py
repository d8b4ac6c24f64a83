"""Raw attention in a freshly traced graph → ``torch.ops.dcpgraph.attention``.

Every front end runs :func:`canonicalize_attention` (a verified pass) right after tracing, so
the compiler passes see attention in exactly one form. Two shapes of attention are recognised,
both in the HF layout ``q [B, Hq, S, D]``, ``k [B, Hkv, S, D]``, ``v [B, Hkv, S, Dv]``::

    # (a) SDPA                                         # (b) hand-written, anchored on softmax
    o = aten.scaled_dot_product_attention(             s = matmul(q, kT)          # kT = k.mT
            q, k, v, attn_mask, dropout_p,             s = s * c  |  s / c        # optional
            is_causal, scale, enable_gqa)              s = masked_fill(s, m, -inf)  |  s + m
                                                         |  where(m, s, -inf)      # the mask
                                                       p = softmax(s, -1)
                                                       p = p.to(dtype) / dropout(eval) …
                                                       o = matmul(p, v)
    # both become
    o = dcpgraph.attention(q, k, v, scale, True)

One module per job:

- :mod:`.patterns`: what counts as attention; the score patterns (written as the functions they
  match, traced once) and the matcher anchored on a softmax;
- :mod:`.gqa`: K/V repeated by hand for GQA (``repeat_interleave``, HF's ``repeat_kv``) traced
  back to the un-repeated tensor, so the facts and the KV cache see the real KV heads;
- :mod:`.masks`: a mask is causal only if evaluating it says so (from shapes and state only);
- :mod:`.rewrite`: planning every rewrite read-only, then applying them; the pass itself;
- :mod:`.nodes`: reading a node's value and shape, and naming where it is in the model.

Nothing is assumed: non-causal SDPA, a non-causal or unprovable mask, dropout > 0, a tensor
scale, an intermediate used outside the attention, a softmax feeding a matmul in any other
arrangement all raise :class:`~dcpgraph.errors.UnsupportedModelError` naming the node, its module
path and the feature. A softmax that does not feed a matmul (an MoE router, say) is left alone.
"""

from __future__ import annotations

from .gqa import kv_sources, unrepeat, untranspose
from .masks import MaskEvaluator, causal_problem
from .nodes import describe_location
from .patterns import attention_softmaxes, match_scores, raw_attention, score_patterns
from .rewrite import AttentionRewrite, canonicalize_attention

__all__ = [
    "AttentionRewrite", "MaskEvaluator", "attention_softmaxes", "canonicalize_attention",
    "causal_problem", "describe_location", "kv_sources", "match_scores", "raw_attention",
    "score_patterns", "unrepeat", "untranspose",
]
