"""``shard_dcp``: cached attention → decode-context-parallel form
(docs/architecture.md, Attention in DCP form).

For each paged (context) attention of a layer, on every rank of a DCP group of ``N``::

    q_all          = all_gather(q, heads)                          # [T, N·H, D]
    o_c, lse_c     = paged_attention(q_all, local cache, local_context_lens)
    o, lse         = merge over the group, back to this rank's H heads:
        comm="a2a":   all_to_all of packed [o_c ‖ lse_c] by head block, then merge_attention
        comm="ag_rs": all_gather(lse_c); rescale_to_global; reduce_scatter(sum) by head block
        comm="ag":    no query gather: q_proj holds the group's heads on every rank, which
                      all-gathers packed [o_c ‖ lse_c] of every head and merges every head; at
                      dcp == tp o_proj is whole and its all-reduce goes (:mod:`.shard_dcp_replicated`)

A sliding window's per-query start ``kv_start`` (a global position, from ``insert_kv_cache``)
becomes this rank's local index ``layout.local_len(kv_start, dcp_rank)``, emitted in the graph
from the ``dcp_rank`` input: a rank's local tokens are in increasing global order, so the keys at
global positions ``>= s`` are exactly its local suffix from ``local_len(s, r)``, and likewise the
keys below a causal bound ``b`` its local prefix of ``local_len(b, r)``.

Sparse (DSA) layers shard their indexer and merge the top-k exactly across the group before the
sparse read, which is then gathered and merged like a context read (:mod:`.shard_dcp_sparse`).
DeepSeek-V4's compressed layers read their window and entries on each rank, merge by LSE over the
group and join the sink once after the merge (:mod:`.shard_dcp_compressed`).

The KV writes stay as they are: the per-rank ``slot_mapping`` input carries −1 for tokens a rank
does not own, so each new token lands in its owner's shard before the read. Every count of keys a
read takes becomes this rank's: the ``context_lens`` input becomes ``local_context_lens`` (per
rank, ``layout.local_len``), and a count computed in the graph (``fuse_new_tokens``'s
``context + new`` lengths and ``position + 1`` causal bounds, a window's start) becomes
``local_len(count, dcp_rank)`` in the graph, once per count. So a fused read attends over the
context and the new tokens this rank holds, and the DCP merge completes the attention. Where the
split was kept (the Ascend backends), the new-token part and the final two-way merge that
``insert_kv_cache`` emitted stay unchanged after the DCP merge. Every rank issues the same
collectives in the same order; the only per-rank
values are inputs (``dcp_rank``, lengths, slots), never control flow.

Cost model for ``comm="auto"`` (:mod:`.shard_dcp_auto`, :mod:`dcpgraph.plan.comm_choice`): the
lowering whose decode step the planner's cost model (:func:`dcpgraph.plan.cost.decode_step`)
predicts cheapest, among those valid for the program (``ag``: GQA reads that
:func:`.shard_dcp_replicated.ag_rules` accepts, and only if its rewritten graph then passes shape
verification; otherwise the next cheapest), over the link of the collective backend in use,
at ``max_model_len // 2`` tokens of context and ``max_num_seqs`` requests. a2a and ag_rs move the
same output bytes, a2a one fp32 lane more per (token, head) in one collective where ag_rs needs two
(its LSE all-gather growing as N²), so a2a wins wherever a collective costs any latency. ag trades
the query gather (and at ``dcp == tp`` the output projection's all-reduce) for ``dcp`` times the
query projection's weight bytes and an ``N``-times larger merge gather: it wins on a
high-latency link (gloo) and loses where collectives are cheap next to the extra weight read.
The choice, with every candidate's predicted per-layer collective time, is recorded in the
program's ``Lowering.comm_choice`` and this pass's provenance.
"""

from __future__ import annotations

import torch

from ..collectives import ALL_GATHER, WAIT
from ..errors import UnsupportedModelError, VerificationError
from ..mesh import Mesh
from ..program import META, RANK, InputSpec, Program
from . import collectives as coll
from .graph_edit import Emitter, add_placeholders, context_reads, getitem_users, nodes_calling
from .manager import program_pass
from .shard_dcp_auto import auto_comm
from .shard_dcp_compressed import shard_compressed
from .shard_dcp_replicated import merge_all_heads, replicate_projections
from .shard_dcp_sparse import shard_indexer
from .verify import propagate_shapes

aten = torch.ops.aten
dcp_ops = torch.ops.dcpgraph
COMMS = ("a2a", "ag_rs", "ag")
KV_LENS, KV_BOUND, KV_START = 5, 6, 8  # paged_attention's arguments counted in keys (global positions)


def _ensures_dcp(program: Program) -> None:
    n = program.mesh.dcp
    if n == 1:
        return
    graph = program.graph_module.graph
    gathers = [x for x in nodes_calling(graph, ALL_GATHER.op) if coll.collective_group(x)[0] == "dcp"]
    extra = program.facts.extra  # a hybrid's layers without attention (as insert_kv_cache counts them)
    without_attention = (len(extra.get("recurrent_layers") or {}) - len(extra.get("attention_beside_recurrent") or [])
                         + len(extra.get("stateless_layers") or []))
    if len(gathers) < program.facts.num_layers - without_attention:
        raise VerificationError("every layer's context attention must gather queries over the DCP group")
    for node in nodes_calling(graph, dcp_ops.paged_attention.default):
        for i, what in ((KV_LENS, "key counts"), (KV_BOUND, "causal bounds")):
            if i < len(node.args) and node.args[i] is not None and not _rank_local(node.args[i]):
                raise VerificationError(f"{node.name} reads global {what} ({node.args[i].name}) under dcp={n}")


def _rank_local(count) -> bool:
    """Whether ``count`` is this rank's: the ``local_context_lens`` input, or computed from ``dcp_rank``."""
    seen, stack = set(), [count]
    while stack:
        node = stack.pop()
        if node.op == "placeholder" and node.name in ("local_context_lens", "dcp_rank"):
            return True
        seen.add(node)
        stack.extend(x for x in node.all_input_nodes if x not in seen)
    return False


@program_pass("shard_dcp", requires=["insert_kv_cache", "shard_tp"], ensures=[_ensures_dcp])
def shard_dcp(program: Program, comm: str = "auto", workload=None):
    """``workload``: what ``comm="auto"`` prices for (:class:`dcpgraph.plan.comm_choice.CommWorkload`;
    None: :mod:`.shard_dcp_auto`'s default engine)."""
    mesh: Mesh = program.mesh
    n = mesh.dcp
    if comm != "auto" and comm not in COMMS:
        raise ValueError(f"comm must be one of {COMMS} or 'auto', got {comm!r}")
    if n == 1:
        return program.replace(lowering=program.lowering.decided(comm="none")), "dcp=1: nothing to shard"
    if comm != "auto":
        return _lower(program, comm)
    if not context_reads(program.graph_module.graph):  # every layer compressed: no dense merge to price
        return _lower(program, "a2a")
    choice = auto_comm(program, workload)
    if choice.comm == "ag":  # its checks passed; its graph must also verify, else the next cheapest
        try:
            lowered, summary = _lower(program, "ag")
            propagate_shapes(lowered)
        except (UnsupportedModelError, VerificationError) as err:
            choice = choice.refuse("ag", f"its lowering failed: {err}")
        else:
            return _with_choice(lowered, summary, choice)
    return _with_choice(*_lower(program, choice.comm), choice)


def _with_choice(program: Program, summary: str, choice) -> tuple[Program, str]:
    return (program.replace(lowering=program.lowering.decided(comm_choice=choice.reason)),
            f"{summary}; comm=auto chose {choice.reason}")


class _ContextReadSharding:
    """Shards each context read of one ``_lower`` run: the query gathered over the DCP group (or,
    ``comm="ag"``, the group's heads computed locally), the key counts made local, and the
    partial results merged by ``comm``. ``local`` maps a global count of keys to this rank's,
    emitted once per count node."""

    def __init__(self, graph, program: Program, comm: str, local_lens, dcp_rank):
        self.graph, self.e, self.comm, self.dcp_rank = graph, Emitter(graph), comm, dcp_rank
        self.n, self.tp = program.mesh.dcp, program.mesh.tp
        # pcp > 1 with dcp | pcp: the group is ranks of one TP rank, holding the same heads and (after
        # split_pcp_prefill's gathers) the same queries, so only the partials are exchanged
        self.same_queries = program.mesh.pcp > 1 and program.mesh.pcp % self.n == 0
        # pcp > 1 with pcp | dcp < ... : the group is n/pcp TP ranks' heads, each held by its pcp PCP
        # ranks with the same (gathered) queries; a2a attends each distinct head block once
        pcp = program.mesh.pcp
        self.copies = pcp if pcp > 1 and self.n > pcp and self.n % pcp == 0 and comm == "a2a" else 1
        self.interleave = int(program.lowering.interleave)
        placeholders = {p.name: p for p in graph.nodes if p.op == "placeholder"}
        self.local: dict = {placeholders["context_lens"]: local_lens}
        self.specs = {s.name: s for s in program.inputs}
        self.rules: dict = {}  # comm="ag": parameters that become replicated
        self.position: dict = {}

    def local_counts(self, count, read):
        """``layout.local_len(count, dcp_rank)``, emitted once per global count node."""
        if count not in self.local:
            with self.graph.inserting_before(read):
                self.local[count] = _emit_local_len(self.e, count, self.dcp_rank, self.n, self.interleave)
        return self.local[count]

    def group_query(self, node):
        """The query of every head of the DCP group, for the context read ``node``."""
        graph, e, q = self.graph, self.e, node.args[0]
        if self.same_queries:
            return q
        if self.comm == "ag":
            replicate_projections(graph, e, node, self.specs, self.rules, self.n, self.tp, self.dcp_rank)
            return q  # now every head of the group, computed here
        with graph.inserting_before(node):
            q_heads_first = e(aten.clone.default, e(aten.transpose.int, q, 0, 1), memory_format=torch.contiguous_format)
            gathered = e(aten.transpose.int, coll.all_gather(graph, q_heads_first, self.n, "dcp"), 0, 1)
            if self.copies == 1:
                return gathered
            # member j = (t·pcp + p) of the group holds head block t: keep the p = 0 copies
            heads, d = q.meta["val"].shape[1:]
            blocks = e(aten.view.default, gathered, [-1, self.n // self.copies, self.copies, heads, d])
            return e(aten.view.default, e(aten.clone.default, e(aten.select.int, blocks, 2, 0),
                                          memory_format=torch.contiguous_format), [-1, self.n // self.copies * heads, d])

    def shard(self, node) -> None:
        """Rewrite one context read; its output and LSE users then read the merged results."""
        graph, e, n, q = self.graph, self.e, self.n, node.args[0]
        heads = q.meta["val"].shape[1]
        dv = node.meta["val"][0].shape[-1]
        q_all = self.group_query(node)
        if node.target is dcp_ops.paged_sparse_attention.default:  # reads its own selection, no lengths
            node.args = (q_all, *node.args[1:])
        else:
            args = list(node.args)
            args[0] = q_all
            for i in (KV_LENS, KV_BOUND, KV_START):  # global counts of keys -> this rank's local counts
                if i < len(args) and args[i] is not None:
                    args[i] = self.local_counts(args[i], node)
            node.args = tuple(args)
        users = getitem_users(node)
        anchor = max((u for us in users.values() for u in us), key=self.position.__getitem__)
        with graph.inserting_before(anchor.next):
            o_c, lse_c = e.getitem(node, 0), e.getitem(node, 1)
            if self.same_queries:
                out, lse = _merge_same_queries(graph, e, node, o_c, lse_c, n, dv, q)
            elif self.comm == "ag":
                out, lse = merge_all_heads(graph, e, o_c, lse_c, n, n * heads, dv,
                                           *(v.dtype for v in node.meta["val"][:2]))
            elif self.comm == "a2a":
                out, lse = _merge_a2a(graph, e, node, o_c, lse_c, n, heads, dv, q, self.copies)
            else:
                out, lse = _merge_ag_rs(graph, e, o_c, lse_c, n, heads, dv, q, self.dcp_rank)
        for index, result in ((0, out), (1, lse)):
            for u in users.get(index, []):
                u.replace_all_uses_with(result)
                graph.erase_node(u)


def _lower(program: Program, comm: str) -> tuple[Program, str]:
    """``program`` lowered with ``comm`` (one of :data:`COMMS`) at its mesh's dcp > 1."""
    n = program.mesh.dcp
    gm = program.copy_graph()
    graph = gm.graph
    local_lens, dcp_rank = add_placeholders(graph, ["local_context_lens", "dcp_rank"])
    sharding = _ContextReadSharding(graph, program, comm, local_lens, dcp_rank)
    compressed = shard_compressed(graph, sharding.e, dcp_rank, n, sharding.interleave, program.mesh.pcp)
    indexers = nodes_calling(graph, dcp_ops.paged_indexer_topk.default)
    for indexer in indexers:
        shard_indexer(graph, sharding.e, indexer, dcp_rank, n, sharding.interleave, _emit_local_len)
    # Graph order of the nodes present now. Rewriting a layer only inserts nodes and erases that
    # layer's getitems, so the later layers' getitems (all this is asked about) keep their order.
    sharding.position = {node: i for i, node in enumerate(graph.nodes)}
    reads = context_reads(graph)
    for node in reads:
        sharding.shard(node)
    graph.eliminate_dead_code()
    overlapped = sum(coll.overlap_wait(w) for w in list(nodes_calling(graph, WAIT))
                     if coll.collective_group(w.args[0])[0] == "dcp")
    gm.recompile()
    rules = sharding.rules
    inputs = (
        *(InputSpec(s.name, s.kind, s.target, rules[s.name]) if s.name in rules else s for s in program.inputs),
        InputSpec("local_context_lens", META, "local_context_lens"),
        InputSpec("dcp_rank", RANK, "dcp_rank"),
    )
    return (
        program.replace(graph_module=gm, inputs=inputs, lowering=program.lowering.decided(comm=comm)),
        f"dcp={n}, comm={comm}: {len(reads)} context attentions sharded"
        + (f"; {len(rules)} projection weights hold the DCP group's heads" if rules else "")
        + (f"; {overlapped} calls moved between a DCP collective and its wait" if overlapped else "")
        + (f"; {len(indexers)} sparse indexers sharded (local top-k, global merge)" if indexers else "")
        + (f"; {compressed} compressed attentions sharded (entries by entry index, sink after the merge)"
           if compressed else ""),
    )


def _emit_local_len(e: Emitter, length, rank, n: int, interleave: int):
    """``layout.local_len`` as graph ops: ``base + clamp(L − base·N − r·I, 0, I)`` with
    ``base = (L // (I·N))·I``, for an int64 tensor ``L`` and this rank's ``dcp_rank`` input ``r``."""
    base = e(aten.mul.Tensor, e(aten.div.Tensor_mode, length, interleave * n, rounding_mode="floor"), interleave)
    rem = e(aten.sub.Tensor, e(aten.sub.Tensor, length, e(aten.mul.Tensor, base, n)),
            e(aten.mul.Tensor, rank, interleave))
    return e(aten.add.Tensor, base, e(aten.clamp.default, rem, 0, interleave))


def _to(e, x, have: torch.dtype, want: torch.dtype):
    """``x`` converted to ``want``, or ``x`` itself when it already is (no copy)."""
    return x if have == want else e(aten._to_copy.default, x, dtype=want)


def _merge_a2a(graph, e, read, o_c, lse_c, n, heads, dv, q, copies: int = 1):
    """Pack ``[o ‖ lse]`` per (token, head) straight into head-block order, exchange head blocks,
    merge locally. The ``cat`` writes the all-to-all's contiguous ``[N, T, H, Dv+1]`` input in one
    copy from the permuted views of the attention's outputs. With ``copies > 1`` the read attended
    ``n / copies`` distinct head blocks, member ``j`` of the group wanting block ``j // copies``:
    each block is sent to its ``copies`` holders (an expand, copied once by the ``cat``)."""
    m = n // copies
    o_blocks = e(aten.permute.default, e(aten.view.default, o_c, [-1, m, heads, dv]), [1, 0, 2, 3])
    lse_blocks = e(aten.permute.default, e(aten.view.default, lse_c, [-1, m, heads]), [1, 0, 2])
    if copies > 1:
        o_blocks = e(aten.reshape.default, e(aten.expand.default, e(aten.unsqueeze.default, o_blocks, 1),
                                             [m, copies, -1, heads, dv]), [n, -1, heads, dv])
        lse_blocks = e(aten.reshape.default, e(aten.expand.default, e(aten.unsqueeze.default, lse_blocks, 1),
                                               [m, copies, -1, heads]), [n, -1, heads])
    blocks = _packed_partial(e, read, q, o_blocks, lse_blocks)
    received = coll.all_to_all(graph, blocks, n, "dcp")  # row i: rank i's partial for my heads
    return _merged_partials(e, q, received, dv)


def _merge_same_queries(graph, e, read, o_c, lse_c, n, dv, q):
    """Every rank of the group attended the same queries over its shard: all-gather the packed
    ``[o ‖ lse]`` partials ``[T, H, Dv+1]`` and merge the ``n`` of them by LSE on every rank."""
    packed = _packed_partial(e, read, q, o_c, lse_c)
    heads = q.meta["val"].shape[1]
    received = e(aten.view.default, coll.all_gather(graph, packed, n, "dcp"), [n, -1, heads, dv + 1])
    return _merged_partials(e, q, received, dv)


def _accumulation_dtype(q) -> torch.dtype:
    """Partials travel and merge in fp32 at least (fp64 stays fp64)."""
    return torch.promote_types(torch.float32, q.meta["val"].dtype)


def _packed_partial(e, read, q, o, lse):
    """``[..., Dv] ‖ [..., 1]``: a rank's partial output and its LSE in one tensor of the
    accumulation dtype, so one collective carries both."""
    acc = _accumulation_dtype(q)
    o_dtype, lse_dtype = (v.dtype for v in read.meta["val"][:2])
    return e(aten.cat.default, [_to(e, o, o_dtype, acc), e(aten.unsqueeze.default, _to(e, lse, lse_dtype, acc), -1)],
             -1)


def _merged_partials(e, q, received, dv: int):
    """The LSE merge over dim 0 of ``received`` ``[N, ..., Dv+1]`` (each row a packed partial),
    as ``(out in q's dtype, lse)``."""
    outs = e(aten.slice.Tensor, received, -1, 0, dv)
    lses = e(aten.select.int, received, -1, dv)
    merged, lse = e.pair(dcp_ops.merge_attention.default, outs, lses)
    return _to(e, merged, _accumulation_dtype(q), q.meta["val"].dtype), lse


def _merge_ag_rs(graph, e, o_c, lse_c, n, heads, dv, q, dcp_rank):
    """All-gather the LSEs, rescale the local partial to its global share, reduce-scatter heads."""
    lses = e(aten.view.default, coll.all_gather(graph, lse_c, n, "dcp"), [n, -1, n * heads])  # [N, T, N·H]
    scaled, lse_global = e.pair(dcp_ops.rescale_to_global.default, o_c, lse_c, lses)
    blocks = e(aten.clone.default, e(aten.permute.default, e(aten.view.default, scaled, [-1, n, heads, dv]), [1, 0, 2, 3]),
               memory_format=torch.contiguous_format)  # [N, T, H, Dv]
    mine = e(aten.select.int, coll.reduce_scatter(graph, blocks, n, "dcp"), 0, 0)  # [T, H, Dv]
    lse = e(aten.squeeze.dim, e(aten.index_select.default, e(aten.view.default, lse_global, [-1, n, heads]), 1,
                                e(aten.view.default, dcp_rank, [1])), 1)
    dtype = q.meta["val"].dtype
    return _to(e, mine, torch.promote_types(torch.float32, dtype), dtype), lse
