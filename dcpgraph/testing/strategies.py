"""Hypothesis strategies for dcpgraph configurations.

They draw *configurations and seeds*, never tensor elements (build tensors from :func:`seeds` with a
``torch.Generator``). Every strategy is a plain function returning a ``SearchStrategy``, so they
compose with ``st.data()``, ``@given`` keyword arguments and ``.flatmap``.

- :func:`dcp_sizes`, :func:`interleaves`, :func:`block_sizes`: the layout knobs;
- :func:`lengths`: sequence lengths biased towards 0, 1, small values and values next to
  multiples of ``dcp·interleave`` (where ``local_len`` changes regime);
- :func:`layouts`: a consistent ``(dcp, interleave, length)`` triple;
- :func:`attention_configs`: MLA (one latent KV head, 576/512 by default) and GQA/MHA shapes,
  including known models and non-powers of two;
- :func:`meshes`: a :class:`~dcpgraph.mesh.Mesh` that is valid for a given attention config;
- :func:`seeds`: 32-bit seeds for ``torch.Generator().manual_seed``.
"""

from __future__ import annotations

from typing import NamedTuple

from hypothesis import assume
from hypothesis import strategies as st

from ..mesh import Mesh

__all__ = [
    "AttentionConfig",
    "INTERLEAVES",
    "KNOWN_MODELS",
    "MAX_LENGTH",
    "attention_configs",
    "block_sizes",
    "dcp_sizes",
    "interleaves",
    "layouts",
    "lengths",
    "meshes",
    "seeds",
    "valid_dcps",
    "valid_tps",
]

#: ``cp_kv_cache_interleave_size`` values worth testing: 1 (default), powers of two, and 128 (the
#: guide's value for KV transfer, equal to the usual block size).
INTERLEAVES: tuple[int, ...] = (1, 2, 4, 8, 16, 128)

#: Upper bound of :func:`lengths` by default (10**5 tokens: long context, still cheap as a tensor).
MAX_LENGTH = 10**5


def dcp_sizes(min_value: int = 1, max_value: int = 16) -> st.SearchStrategy[int]:
    """DCP group sizes in ``[min_value, max_value]`` (default 1..16), non-powers of two included."""
    return st.integers(min_value=min_value, max_value=max_value)


def interleaves(values: tuple[int, ...] = INTERLEAVES) -> st.SearchStrategy[int]:
    """Interleave sizes, sampled from ``{1, 2, 4, 8, 16, 128}`` by default (shrinks towards 1)."""
    return st.sampled_from(values)


def block_sizes(interleave: int = 1, max_multiple: int = 8) -> st.SearchStrategy[int]:
    """Physical block sizes valid for ``interleave``: ``interleave · k`` with ``1 <= k <= max_multiple``."""
    return st.integers(min_value=1, max_value=max_multiple).map(lambda k: k * interleave)


@st.composite
def lengths(
    draw: st.DrawFn,
    dcp: int | None = None,
    interleave: int | None = None,
    *,
    max_value: int = MAX_LENGTH,
) -> int:
    """Sequence lengths in ``[0, max_value]``, biased to the values where layout bugs live.

    Mixes 0, 1, small lengths, uniform lengths, and lengths within ±2 tokens of a multiple of
    ``period = dcp·interleave`` (or ± ``interleave`` around ``k·period + r·interleave``, the points
    where rank ``r``'s share starts or stops growing). With ``dcp``/``interleave`` left ``None``, the
    period comes from a drawn DCP size and interleave.
    """
    if dcp is None:
        dcp = draw(dcp_sizes())
    if interleave is None:
        interleave = draw(interleaves())
    period = dcp * interleave
    kind = draw(st.sampled_from(("zero", "one", "small", "near-period", "near-rank", "any")))
    if kind == "zero":
        return 0
    if kind == "one":
        return min(1, max_value)
    if kind == "small":
        return draw(st.integers(0, min(3 * period + 2, 64, max_value)))
    if kind == "any":
        return draw(st.integers(0, max_value))
    k = draw(st.integers(0, max(max_value // period, 0)))
    if kind == "near-period":
        value = k * period + draw(st.integers(-2, 2))
    else:  # near a rank boundary inside the period
        r = draw(st.integers(0, dcp - 1))
        value = k * period + r * interleave + draw(st.integers(-1, 1)) * draw(
            st.sampled_from((0, 1, interleave))
        )
    return min(max(value, 0), max_value)


@st.composite
def layouts(draw: st.DrawFn, *, max_length: int = MAX_LENGTH) -> tuple[int, int, int]:
    """``(dcp, interleave, length)`` with the length biased to that layout's boundaries."""
    dcp = draw(dcp_sizes())
    interleave = draw(interleaves())
    return dcp, interleave, draw(lengths(dcp, interleave, max_value=max_length))


def seeds() -> st.SearchStrategy[int]:
    """Seeds for ``torch.Generator().manual_seed`` (tensors come from these, not from hypothesis)."""
    return st.integers(min_value=0, max_value=2**32 - 1)


class AttentionConfig(NamedTuple):
    """Head counts and dims of one attention layer.

    ``kind`` is ``"mla"`` (one latent KV head shared by all query heads; ``head_dim`` is the
    query/key dim ``kv_lora_rank + rope_dim``, ``value_dim`` the latent ``kv_lora_rank``) or
    ``"gqa"`` (MHA is GQA with ``num_kv_heads == num_q_heads``).
    """

    kind: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    value_dim: int

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads


#: Real shapes the guide and docs/architecture.md talk about (MLA with the weight-absorbed latent layout).
KNOWN_MODELS: dict[str, AttentionConfig] = {
    "DeepSeek-V2-Lite": AttentionConfig("mla", 16, 1, 576, 512),
    "DeepSeek-R1": AttentionConfig("mla", 128, 1, 576, 512),
    "Qwen3-235B-A22B": AttentionConfig("gqa", 64, 4, 128, 128),
    "Llama-3-70B": AttentionConfig("gqa", 64, 8, 128, 128),
    "Qwen2.5-7B": AttentionConfig("gqa", 28, 4, 128, 128),
    "Mistral-7B": AttentionConfig("gqa", 32, 8, 128, 128),
    "GPT-2": AttentionConfig("gqa", 12, 12, 64, 64),
}

_GQA_HEAD_DIMS = (16, 32, 64, 128, 256, 24, 40, 72, 80, 96, 112, 192)
_Q_HEADS_MLA = (1, 2, 4, 8, 16, 32, 64, 128, 3, 6, 12, 20, 24, 40, 96)


@st.composite
def attention_configs(
    draw: st.DrawFn,
    kinds: tuple[str, ...] = ("mla", "gqa"),
    *,
    max_q_heads: int = 128,
    max_head_dim: int = 576,
    known: bool = True,
) -> AttentionConfig:
    """Attention shapes: MLA latents (576 query/key dim, 512 value dim, or small latents within
    ``max_head_dim``), GQA/MQA/MHA with head counts and dims that are not powers of two, and — with
    ``known`` — the shapes of :data:`KNOWN_MODELS` that fit the bounds.

    Lower ``max_q_heads``/``max_head_dim`` for tests that run real attention on a CPU.
    """
    if not kinds or any(k not in ("mla", "gqa") for k in kinds):
        raise ValueError(f"kinds must be a non-empty subset of ('mla', 'gqa'), got {kinds!r}")
    if known:
        fitting = [
            cfg
            for cfg in KNOWN_MODELS.values()
            if cfg.kind in kinds
            and cfg.num_q_heads <= max_q_heads
            and max(cfg.head_dim, cfg.value_dim) <= max_head_dim
        ]
        if fitting and draw(st.integers(0, 3)) == 0:
            return draw(st.sampled_from(fitting))
    kind = draw(st.sampled_from(kinds))
    if kind == "mla":
        q_heads = draw(
            st.sampled_from([h for h in _Q_HEADS_MLA if h <= max_q_heads] or [1])
            | st.integers(1, max_q_heads)
        )
        if max_head_dim >= 576 and draw(st.booleans()):
            return AttentionConfig("mla", q_heads, 1, 576, 512)
        rope = draw(st.sampled_from((0, 8, 16, 64)).filter(lambda r: r < max_head_dim))
        latent = draw(st.integers(1, max_head_dim - rope))
        return AttentionConfig("mla", q_heads, 1, latent + rope, latent)
    # GQA: num_kv_heads · group_size query heads.
    kv_heads = draw(st.integers(1, min(16, max_q_heads)))
    group = draw(st.integers(1, max(1, min(8, max_q_heads // kv_heads))))
    head_dims = [d for d in _GQA_HEAD_DIMS if d <= max_head_dim] or [max_head_dim]
    head_dim = draw(st.sampled_from(head_dims) | st.integers(1, max_head_dim))
    value_dim = head_dim if draw(st.booleans()) else draw(st.sampled_from(head_dims))
    return AttentionConfig("gqa", kv_heads * group, kv_heads, head_dim, value_dim)


def valid_tps(cfg: AttentionConfig, max_tp: int = 16) -> list[int]:
    """TP sizes in ``1..max_tp`` that can shard ``cfg`` (query heads split evenly; GQA KV heads
    split evenly or replicated evenly)."""
    return [
        tp
        for tp in range(1, max_tp + 1)
        if cfg.num_q_heads % tp == 0
        and (cfg.kind == "mla" or cfg.num_kv_heads % tp == 0 or tp % cfg.num_kv_heads == 0)
    ]


def valid_dcps(cfg: AttentionConfig, tp: int) -> list[int]:
    """DCP sizes the guide allows at this ``tp``: MLA ``tp % dcp == 0``; GQA also
    ``(tp // n_kv) >= dcp`` and ``(tp // n_kv) % dcp == 0``."""
    out = []
    for dcp in range(1, tp + 1):
        if tp % dcp:
            continue
        if cfg.kind == "gqa" and dcp > 1:
            replicas = tp // cfg.num_kv_heads
            if replicas < dcp or replicas % dcp:
                continue
        out.append(dcp)
    return out


@st.composite
def meshes(
    draw: st.DrawFn, cfg: AttentionConfig, *, max_tp: int = 16, min_dcp: int = 1
) -> Mesh:
    """A :class:`Mesh` (``pcp == 1``) that ``cfg`` validates against.

    With ``min_dcp > 1`` only meshes that actually shard the KV cache are drawn; the strategy is
    rejected (hypothesis ``assume``) where ``cfg`` admits none within ``max_tp``.
    """
    options = [
        (tp, dcp)
        for tp in valid_tps(cfg, max_tp)
        for dcp in valid_dcps(cfg, tp)
        if dcp >= min_dcp
    ]
    assume(options)
    tp, dcp = draw(st.sampled_from(options))
    return Mesh(tp=tp, dcp=dcp)
