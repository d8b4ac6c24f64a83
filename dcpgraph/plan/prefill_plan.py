"""The planner's prefill table: time to first token of one ``prompt_len``-token prompt for every
``(tp, pcp)`` layout of the world, from :func:`.prefill_cost.prefill_estimate`.

A layout of ``W`` ranks runs ``W / (tp · pcp)`` replicas of a ``tp · pcp``-rank engine. Its
validity is :meth:`dcpgraph.Mesh.validate` at ``dcp = 1`` (TTFT does not depend on how decode
later shards the cache). The PCP K/V all-gather runs over a group of ranks ``p · tp + t``; when
one replica spans nodes (``tp · pcp`` ranks cut from a world numbered node by node), the exchange
and the all-reduces are charged the inter-node link (:func:`.cost.link_for`), the conservative
choice, since the PCP group then crosses nodes whenever its TP group does not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ConfigError
from ..mesh import Mesh
from .cost import link_for
from .hardware import Hardware, nodes_spanned
from .model_shape import ModelShape
from .prefill_cost import PrefillEstimate, prefill_estimate


@dataclass
class PrefillRow:
    tp: int
    pcp: int
    replicas: int
    valid: bool
    rule: str = ""  # Mesh.validate's message for an invalid layout, or why the weights do not fit
    weight_bytes_per_rank: int = 0
    nodes: int = 1  # nodes one replica spans
    estimate: PrefillEstimate | None = None
    speedup: float = 0.0  # TTFT at (tp, pcp=1) ÷ this row's TTFT; 0 where pcp=1 at this tp is invalid

    @property
    def fits(self) -> bool:
        return self.valid and not self.rule

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "estimate"}
        d["fits"] = self.fits
        if self.estimate is not None:
            e = self.estimate
            d.update(tokens_per_rank=e.tokens_per_rank, compute_ms=e.compute_s * 1e3,
                     exchange_ms=e.exchange_s * 1e3, allreduce_ms=e.allreduce_s * 1e3,
                     exchange_bytes_per_rank=e.exchange_bytes, ttft_ms=e.ttft_s * 1e3)
        return d


def _world_link(hw: Hardware, nodes: int) -> Hardware:
    """``hw`` with its link replaced by the one a group spanning ``nodes`` nodes runs at."""
    latency, bandwidth = link_for(hw, nodes)
    return replace(hw, link_latency_s=latency, link_bandwidth=bandwidth)


def prefill_rows(shape: ModelShape, hw: Hardware, *, world_size: int, per_node: int, prompt_len: int,
                 weight_bytes: float, weight_budget_bytes: int,
                 pcp_sizes: tuple[int, ...] | None = None) -> list[PrefillRow]:
    """One row per ``(tp, pcp)`` with ``tp · pcp`` dividing ``world_size`` (``pcp`` restricted to
    ``pcp_sizes`` when given), largest tp first. Every PCP rank holds its TP share of the weights
    (``weight_bytes`` per parameter); a layout whose share exceeds ``weight_budget_bytes`` per
    rank is listed as not fitting, with its estimate."""
    if prompt_len < 1:
        raise ConfigError(f"prompt_len must be >= 1, got {prompt_len}")
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    if pcp_sizes is not None:
        bad = [p for p in pcp_sizes if p not in divisors]
        if bad:
            raise ConfigError(f"pcp {bad} do not divide world_size={world_size}; valid pcp: {divisors}")
    rows: list[PrefillRow] = []
    for tp in sorted(divisors, reverse=True):
        base_ttft = 0.0
        for pcp in sorted(pcp_sizes or divisors):
            if world_size % (tp * pcp):
                continue
            row = PrefillRow(tp, pcp, world_size // (tp * pcp), True,
                             nodes=nodes_spanned(tp * pcp, world_size, per_node))
            try:
                Mesh(tp, 1, pcp).validate(attention=shape.attention, num_q_heads=shape.num_q_heads,
                                          num_kv_heads=shape.num_kv_heads)
            except ConfigError as err:
                row.valid, row.rule = False, str(err)
                rows.append(row)
                continue
            row.weight_bytes_per_rank = int(shape.weight_params_per_rank(tp) * weight_bytes)
            if row.weight_bytes_per_rank > weight_budget_bytes:
                row.rule = (f"weights {row.weight_bytes_per_rank / 2**30:,.1f} GiB per rank exceed the "
                            f"{weight_budget_bytes / 2**30:,.1f} GiB budget")
            row.estimate = prefill_estimate(shape, _world_link(hw, row.nodes), tp=tp, pcp=pcp,
                                            prompt_tokens=prompt_len)
            if pcp == 1:
                base_ttft = row.estimate.ttft_s
            row.speedup = base_ttft / row.estimate.ttft_s if base_ttft else 0.0
            rows.append(row)
    return rows


def fastest(rows: list[PrefillRow]) -> PrefillRow | None:
    """The fitting row with the smallest TTFT; ties go to fewer ranks per replica (more replicas)."""
    valid = [r for r in rows if r.fits]
    return min(valid, key=lambda r: (round(r.estimate.ttft_s, 9), r.tp * r.pcp, r.pcp), default=None)
