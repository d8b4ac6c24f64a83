"""The device mesh: ``pcp`` TP groups of ``tp`` ranks, whose attention ranks are cut into DCP groups.

DCP adds no ranks; PCP (prefill context parallel) does: the world is ``tp · pcp`` ranks, global
rank ``p·tp + t`` being TP rank ``t`` of PCP replica ``p`` (TP innermost, as vLLM lays ranks out).
Every PCP replica holds the same TP shard of the weights. DCP groups are consecutive runs of ``dcp``
in *attention order* ``t·pcp + p`` (the PCP axis fastest, then TP), so with pcp=1 they are
consecutive TP ranks. With tp=8, dcp=2 the DCP groups are {0,1}, {2,3},
{4,5}, {6,7}. GQA replicates KV head ``k`` on the ``tp // n_kv`` consecutive ranks
``[k·tp/n_kv, (k+1)·tp/n_kv)``; a DCP group must sit inside one such replica set, which is why the
groups are consecutive and why ``(tp // n_kv) % dcp == 0`` is required.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class Mesh:
    """``pcp`` tensor-parallel groups of ``tp`` ranks; DCP groups are consecutive runs of ``dcp``
    attention ranks in attention order (``t·pcp + p``)."""

    tp: int
    dcp: int = 1
    pcp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dcp", "pcp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pcp

    @property
    def ranks(self) -> range:
        return range(self.world_size)

    # -- attention order: t·pcp + p ------------------------------------------------------------
    def attention_index(self, rank: int) -> int:
        """``tp_rank · pcp + pcp_rank``: the order DCP groups are cut from (PCP axis fastest)."""
        return self.tp_rank(rank) * self.pcp + self.pcp_rank(rank)

    def _rank_at(self, attention_index: int) -> int:
        t, p = divmod(attention_index, self.pcp)
        return p * self.tp + t

    # -- DCP groups -------------------------------------------------------------------------
    def dcp_group(self, rank: int) -> tuple[int, ...]:
        """Global ranks of the DCP group that holds ``rank`` (consecutive in attention order;
        consecutive global ranks when pcp=1)."""
        start = (self.attention_index(rank) // self.dcp) * self.dcp
        return tuple(self._rank_at(a) for a in range(start, start + self.dcp))

    def dcp_rank(self, rank: int) -> int:
        """Position of ``rank`` inside its DCP group: the rank that owns tokens with owner == this."""
        return self.attention_index(rank) % self.dcp

    def dcp_groups(self) -> list[tuple[int, ...]]:
        return [self.dcp_group(self._rank_at(a)) for a in range(0, self.world_size, self.dcp)]

    # -- TP groups: one per PCP replica ----------------------------------------------------------
    def tp_group(self, rank: int) -> tuple[int, ...]:
        """The ``tp`` ranks of ``rank``'s PCP replica (the whole world when pcp=1)."""
        start = self.pcp_rank(rank) * self.tp
        return tuple(range(start, start + self.tp))

    def tp_rank(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.tp

    # -- PCP groups: the ranks that hold the same TP shard ---------------------------------------
    def pcp_group(self, rank: int) -> tuple[int, ...]:
        """The ``pcp`` ranks with ``rank``'s TP rank: the group a prefill's tokens are split over."""
        t = self.tp_rank(rank)
        return tuple(p * self.tp + t for p in range(self.pcp))

    def pcp_rank(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.tp

    def group(self, kind: str, rank: int) -> tuple[int, ...]:
        """Ranks of the ``kind`` ("tp", "dcp", "pcp" or "ep") group that holds ``rank``; one
        deployment's EP group is its whole world (:class:`ReplicaMesh` joins several)."""
        if kind == "tp":
            return self.tp_group(rank)
        if kind == "dcp":
            return self.dcp_group(rank)
        if kind == "pcp":
            return self.pcp_group(rank)
        if kind == "ep":
            self._check_rank(rank)
            return tuple(self.ranks)
        raise ValueError(f"unknown group kind {kind!r}; expected 'tp', 'dcp', 'pcp' or 'ep'")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the mesh (tp={self.tp}, pcp={self.pcp}: "
                             f"{self.world_size} ranks)")

    # -- validation ----------------------------------------------------------------------------
    def validate(
        self,
        *,
        attention: str,
        num_q_heads: int,
        num_kv_heads: int | None = None,
        block_size: int = 16,
        interleave: int = 1,
        layer_kv_heads: Sequence[int] = (),
    ) -> Mesh:
        """Check this mesh against a model; raise :class:`ConfigError` naming the failed rule.

        Rules (docs/architecture.md, Mesh and constraints; the vLLM Ascend guide; TP's own):

        - ``block_size % interleave == 0``; ``num_q_heads % tp == 0``;
        - MLA (one latent KV head): ``(tp · pcp) % dcp == 0`` (with pcp=1: ``tp % dcp == 0``);
        - GQA: ``num_kv_heads % tp == 0`` or ``tp % num_kv_heads == 0`` (TP), and for dcp > 1 a
          DCP group sits inside one KV head's replica set of ``max(tp // num_kv_heads, 1) · pcp``
          attention ranks: ``(max(tp // num_kv_heads, 1) · pcp) % dcp == 0``. With pcp=1 that is
          ``tp > num_kv_heads``, ``(tp // num_kv_heads) >= dcp`` and ``(tp // num_kv_heads) % dcp == 0``.
        - GQA with ``layer_kv_heads`` (one count per attention layer, for models whose layers
          differ): the GQA rules hold for every layer's count; the error names the first layer
          that breaks them and the dcp values valid for every layer.
        """
        self._check_any_attention(attention, num_q_heads, block_size, interleave)
        if attention == "gqa" and layer_kv_heads:
            self._check_layers(num_q_heads, tuple(layer_kv_heads))
        elif attention == "gqa":
            self._check_gqa(num_q_heads, num_kv_heads)
        return self

    def _check_layers(self, num_q_heads: int, layer_kv_heads: tuple[int, ...]) -> None:
        """The GQA rules for each distinct per-layer KV head count, in layer order."""
        first_layer = {}
        for layer, heads in enumerate(layer_kv_heads):
            first_layer.setdefault(heads, layer)
        for heads, layer in first_layer.items():
            try:
                self._check_gqa(num_q_heads, heads)
            except ConfigError as exc:
                counts = sorted(first_layer)
                valid = [d for d in range(1, self.tp * self.pcp + 1) if (self.tp * self.pcp) % d == 0
                         and (self.pcp > 1 or self.tp % d == 0) and _gqa_valid(Mesh(self.tp, d, self.pcp), num_q_heads, counts)]
                raise ConfigError(
                    f"layer {layer} ({heads} KV heads; the model's layers have {counts}) breaks the mesh: "
                    f"{exc}. Valid dcp at tp={self.tp} for every layer: {valid or 'none'}"
                ) from exc

    def _check_any_attention(self, attention: str, num_q_heads: int, block_size: int, interleave: int) -> None:
        """The rules every model meets (MLA's are these alone): interleave, query heads, dcp | tp·pcp."""
        tp, dcp, pcp = self.tp, self.dcp, self.pcp
        if attention not in ("mla", "gqa"):
            raise ConfigError(f"attention must be 'mla' or 'gqa', got {attention!r}")
        if block_size < 1 or interleave < 1 or block_size % interleave:
            good = [i for i in range(1, block_size + 1) if block_size % i == 0] if block_size > 0 else []
            raise ConfigError(
                f"block_size % interleave == 0 failed: block_size={block_size}, interleave={interleave}; "
                f"valid interleaves for this block size: {good}"
            )
        if num_q_heads % tp:
            valid = [t for t in range(1, num_q_heads + 1) if num_q_heads % t == 0]
            raise ConfigError(
                f"num_q_heads % tp == 0 failed: {num_q_heads} query heads cannot be split over "
                f"tp={tp}; valid tp: {valid}"
            )
        if pcp == 1 and tp % dcp:
            valid = [d for d in range(1, tp + 1) if tp % d == 0]
            raise ConfigError(
                f"tp % dcp == 0 failed: dcp={dcp} does not divide tp={tp}; valid dcp: {valid}"
            )
        if (tp * pcp) % dcp:
            valid = [d for d in range(1, tp * pcp + 1) if (tp * pcp) % d == 0]
            raise ConfigError(
                f"(tp · pcp) % dcp == 0 failed: dcp={dcp} does not divide the tp·pcp = {tp * pcp} "
                f"attention ranks (tp={tp}, pcp={pcp}); valid dcp: {valid}"
            )

    def _check_gqa(self, num_q_heads: int, num_kv_heads: int | None) -> None:
        """GQA's KV-head rules: TP splits or replicates whole KV heads, and a DCP group sits inside
        one KV head's replica set."""
        tp, dcp = self.tp, self.dcp
        if num_kv_heads is None or num_kv_heads < 1:
            raise ConfigError(f"GQA needs num_kv_heads >= 1, got {num_kv_heads!r}")
        if num_q_heads % num_kv_heads:
            raise ConfigError(
                f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if num_kv_heads % tp and tp % num_kv_heads:
            valid = [t for t in range(1, 2 * max(num_kv_heads, tp) + 1)
                     if (num_kv_heads % t == 0 or t % num_kv_heads == 0) and num_q_heads % t == 0]
            raise ConfigError(
                f"num_kv_heads % tp == 0 or tp % num_kv_heads == 0 failed: {num_kv_heads} KV heads "
                f"at tp={tp}; valid tp: {valid}"
            )
        if dcp == 1:
            return
        if self.pcp > 1:
            replicas = max(tp // num_kv_heads, 1) * self.pcp
            if replicas % dcp:
                valid = [d for d in range(1, replicas + 1) if replicas % d == 0]
                raise ConfigError(
                    f"(max(tp // num_kv_heads, 1) · pcp) % dcp == 0 failed: each KV head is held by "
                    f"max({tp} // {num_kv_heads}, 1) · {self.pcp} = {replicas} attention ranks, and a DCP "
                    f"group must sit inside that set; dcp={dcp} does not. Valid dcp at tp={tp}, "
                    f"pcp={self.pcp}: {valid}"
                )
            return
        if tp <= num_kv_heads:
            raise ConfigError(
                f"dcp={dcp} with tp={tp} <= num_kv_heads={num_kv_heads}: every rank already holds "
                "distinct KV heads, so there is no KV replication for DCP to remove. Use dcp=1, or "
                f"raise tp above {num_kv_heads} (e.g. tp={2 * num_kv_heads} allows dcp=2)"
            )
        replicas = tp // num_kv_heads
        if replicas < dcp or replicas % dcp:
            valid = [d for d in range(1, replicas + 1) if replicas % d == 0]
            raise ConfigError(
                f"(tp // num_kv_heads) >= dcp and (tp // num_kv_heads) % dcp == 0 failed: each KV "
                f"head is replicated on tp // num_kv_heads = {replicas} ranks, and a DCP group must "
                f"sit inside one replica set; dcp={dcp} does not. Valid dcp at tp={tp}: {valid}"
            )

    def __str__(self) -> str:
        groups = " ".join("{" + ",".join(map(str, g)) + "}" for g in self.dcp_groups())
        pcp = f", pcp={self.pcp}" if self.pcp > 1 else ""
        return f"Mesh(tp={self.tp}{pcp}, dcp={self.dcp}; dcp groups {groups})"


@dataclass(frozen=True)
class ReplicaMesh:
    """``replicas`` data-parallel copies of ``mesh`` joined by one EP group: global rank
    ``d·W + r`` is rank ``r`` of replica ``d`` (``W = mesh.world_size``). TP, DCP and PCP groups
    stay inside a replica; the EP group is all ``replicas·W`` ranks, in global-rank order, so EP
    rank ``d·tp + t`` is TP rank ``t`` of replica ``d`` (with pcp=1)."""

    mesh: Mesh
    replicas: int

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool) or self.replicas < 1:
            raise ConfigError(f"replicas must be a positive int, got {self.replicas!r}")

    @property
    def world_size(self) -> int:
        return self.mesh.world_size * self.replicas

    @property
    def ranks(self) -> range:
        return range(self.world_size)

    def replica_of(self, rank: int) -> tuple[int, int]:
        """``(replica, rank inside it)``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside {self.replicas} replicas of {self.mesh.world_size} ranks")
        return divmod(rank, self.mesh.world_size)

    def group(self, kind: str, rank: int) -> tuple[int, ...]:
        if kind == "ep":
            self.replica_of(rank)
            return tuple(self.ranks)
        replica, local = self.replica_of(rank)
        base = replica * self.mesh.world_size
        return tuple(base + r for r in self.mesh.group(kind, local))


def _gqa_valid(mesh: Mesh, num_q_heads: int, kv_head_counts: list[int]) -> bool:
    """Whether ``mesh`` meets the GQA rules for every KV head count in ``kv_head_counts``."""
    try:
        for heads in kv_head_counts:
            mesh._check_gqa(num_q_heads, heads)
    except ConfigError:
        return False
    return True


def local_kv_heads(num_kv_heads: int, tp: int) -> int:
    """KV heads one TP rank holds: its share, or one replicated head when ``tp > num_kv_heads``
    (the rule :mod:`dcpgraph.passes.shard_tp` shards by; the planner sizes caches with it)."""
    return num_kv_heads // tp if num_kv_heads >= tp else 1
