"""``split_pcp_prefill``: each PCP rank computes its zigzag share of a step's tokens.

With ``pcp > 1`` the step's ``T`` tokens are split over the ``pcp`` ranks of each PCP group
(:mod:`dcpgraph.pcp.step_rows`: per request the zigzag split of :mod:`dcpgraph.pcp.split`). Each
rank gets two inputs: ``pcp_rows [L]``, the step rows it computes (padded with row 0 to the
group's longest share), and ``pcp_order [T]``, the row of every step token in a PCP all-gather of
``[L, ...]`` pieces. The pass rewrites the canonical program (before ``insert_kv_cache``):

- ``input_ids`` and ``position_ids`` are read at ``pcp_rows``: embeddings, projections, norms,
  rotary and the MLP run on this rank's ``L`` rows only;
- each canonical attention's ``q``, ``k`` and ``v`` ``[1, H, L, D]`` are all-gathered over the PCP
  group and put back in step order (``gathered[pcp_order]``, ``[1, H, T, D]``); the attention then
  runs on the whole step exactly as at ``pcp = 1`` (``insert_kv_cache`` writes every new token to
  its DCP owner's shard and reads the context, ``shard_dcp`` shards that read over the DCP group,
  whose ranks now hold the same queries), and its output is read back at ``pcp_rows``;
- the LM head's input is all-gathered the same way, so ``select_logits`` picks step rows and every
  rank samples from the same logits.

An MTP layer's program (:mod:`dcpgraph.speculative.mtp_module`) has a third token input,
``hidden_states [1, T, H]`` (the target's final hidden state of every step row, the same on every
rank), read at ``pcp_rows`` like the token ids, and returns its own output state ``x [1, L, H]``
(``Lowering.hidden_states_output``) for chaining drafts: that output is all-gathered into step
order ``[1, T, H]``, so every rank reads the state of any row (one more ``[T, H]`` gather per step).
A target compiled for MTP gets its hidden-states output later (``return_hidden_states``), from the
LM head's gathered input: it is in step order already.

Sparse attention (SFA/DSA): each ``indexer_topk``'s query, key and head weights ``[1, L, ...]``
are all-gathered the same way, so every rank scores every step query against every earlier index
key and takes the ``pcp = 1`` top-k of each row; its queries are always gathered (the sparse path
reads the whole step). MLA's value, a slice of its key, is sliced from the gathered key.
A window's, chunk's, soft-cap's or sink's bound is per query position or per head, so windowed
attention splits like causal attention.

Compressed attention (DeepSeek-V4 CSA/HCA, :func:`_gather_compressed`): a compressor's windows
span the PCP ranks' rows and its open window is per-request state, so each ``compress_windows``
gets its ``kv``/``gate`` inputs gathered and pools the whole step (every rank writes the same open
window), its row-form output read back at ``pcp_rows`` for the entries' row-wise norm and rotary;
each ``compressed_topk`` (the indexer's query, head weights, keys) and ``compressed_attention``
(query, K=V head, entries) reads gathered operands and the step's positions, so each row's
selection and attention are those of ``pcp = 1``, read back at ``pcp_rows``.

With ``dcp = 1`` (and the fused paged read, ``fuse_new_tokens``, no sparse layer) the queries stay local
(``queries="rank"``): only ``k``/``v`` are gathered, and :func:`split_pcp_attention`, after
``fuse_new_tokens``, gives each paged read this rank's request boundaries (``pcp_cu_seqlens_q``)
and causal bounds (``position + 1`` at ``pcp_rows``), so each rank attends its zigzag rows only
and the causal work splits ``1/pcp`` as in the eager path. Where the DCP group is ``1 < dcp <
pcp`` PCP ranks of one TP rank (``queries="group"``) the gathered queries are read at the group's
rows (``pcp_group_rows``, :func:`dcpgraph.pcp.step_rows.pcp_group_rows`) and the paged read is
bounded the same way, so each of the group's ranks attends ``dcp/pcp`` of the rows over ``1/dcp``
of the keys. Otherwise (``queries="step"``: the DCP group spans every PCP rank) the attention runs
on the whole step on every PCP rank, over its ``1/dcp`` DCP shard.

Every value a rank computes for a row is what ``pcp = 1`` computes for it (row-wise ops on the
same inputs; attention over the same keys with the same bound), so the tokens are exact. The dense
work (projections, MLP) is split ``1/pcp``. A decode step is split the same way (one token per
request goes to PCP rank 0; the others compute padding), so ``pcp`` adds no decode throughput.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedModelError, VerificationError
from ..mesh import Mesh
from ..ops import compressed as _compressed_ops  # noqa: F401  (registers the canonical compressed ops)
from ..program import META, RANK, InputSpec, Program
from . import collectives as coll
from .graph_edit import Emitter, add_placeholders, nodes_calling, output_node
from .manager import not_yet_run, program_pass
from .select_logits import find_logits_linear

aten = torch.ops.aten
dcp_ops = torch.ops.dcpgraph
QUERY_ROWS = ("step", "rank", "group")
ATTENTION = dcp_ops.attention.default
PAGED = dcp_ops.paged_attention.default
SPARSE = dcp_ops.sparse_attention.default
COMPRESSED = dcp_ops.compressed_attention.default
COMPRESS = dcp_ops.compress_windows.default
COMPRESSED_TOPK = dcp_ops.compressed_topk.default


def _ensures(program: Program) -> None:
    graph = program.graph_module.graph
    if not any(n.op == "placeholder" and n.name == "pcp_order" for n in graph.nodes):
        return
    for node in nodes_calling(graph, ATTENTION):
        for operand in node.args[1:3]:  # the query too, unless split_pcp_attention reads it locally
            if not _step_ordered(operand):
                raise VerificationError(f"{node.name}: {operand.name} is not all-gathered over the PCP group")
    for node in nodes_calling(graph, SPARSE):
        for operand in (*node.args[:3], *node.args[3].args[:3]):  # q, k, v and the indexer's q, k, weights
            if not _step_ordered(operand):
                raise VerificationError(f"{node.name}: {operand.name} is not all-gathered over the PCP group")
    for node in [*nodes_calling(graph, COMPRESS), *nodes_calling(graph, COMPRESSED_TOPK),
                 *nodes_calling(graph, COMPRESSED)]:
        operands = node.args[:2] if node.target is COMPRESS else node.args[:3]
        for operand in operands:  # the compressor's kv/gate; the indexer's q/weights/keys; the q/kv/entries
            if not _step_ordered(operand):
                raise VerificationError(f"{node.name}: {operand.name} is not all-gathered over the PCP group")
    linear = find_logits_linear(graph)
    if not _step_ordered(linear.args[0]):
        raise VerificationError(f"the LM head {linear.name} reads rows not gathered over the PCP group")
    index = program.lowering.hidden_states_output
    if index is not None and not _step_ordered(_outputs(graph)[index]):
        raise VerificationError(f"hidden-states output {index} is not all-gathered over the PCP group")


def _step_ordered(node) -> bool:
    """Whether ``node`` is a PCP all-gather read back in step order (:func:`_gather_rows`)."""
    seen, stack = set(), [node]
    while stack:
        x = stack.pop()
        if x.op == "call_function" and x.target is aten.index_select.default and x.args[2].name == "pcp_order":
            return True
        seen.add(x)
        if x.op == "call_function" and (x.target in (aten.transpose.int, aten.unsqueeze.default)
                                        or (x.target is aten.slice.Tensor and x.args[1] in (-1, 3))):
            stack.extend(a for a in x.all_input_nodes if a not in seen)
    return False


@program_pass(
    "split_pcp_prefill",
    requires=[not_yet_run("insert_kv_cache", "it rewrites the canonical attention, which insert_kv_cache replaces"),
              not_yet_run("select_logits", "the LM head must read every step row before the logits rows are picked")],
    ensures=[_ensures],
)
def split_pcp_prefill(program: Program, mesh: Mesh, queries: str = "step"):
    """``mesh``: the one being compiled for (``program.mesh`` is set later, by ``shard_tp``).
    ``queries``: which rows each attention's queries are, one of :data:`QUERY_ROWS`: ``"step"``,
    every step row (gathered over the PCP group); ``"rank"``, this rank's ``L`` rows (only
    ``k``/``v`` are gathered); ``"group"``, the rows of this rank's DCP group
    (``pcp_group_rows``, taken from the gathered step; the output is read back at
    ``pcp_own_in_group``). With ``"rank"`` and ``"group"`` the attention is only right once
    :func:`split_pcp_attention` has given the fused paged read those rows' request boundaries and
    causal bounds."""
    if queries not in QUERY_ROWS:
        raise ValueError(f"queries must be one of {QUERY_ROWS}, got {queries!r}")
    local_queries = queries == "rank"
    if mesh.pcp == 1:
        return program, "pcp=1: nothing to split"
    gm = program.copy_graph()
    graph = gm.graph
    e = Emitter(graph)
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    rows, order = add_placeholders(graph, ["pcp_rows", "pcp_order"])
    group_rows, own_in_group = add_placeholders(graph, ["pcp_group_rows", "pcp_own_in_group"]) \
        if queries == "group" else (None, None)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    selected = 0
    local_inputs = {}
    for name in ("input_ids", "position_ids", "hidden_states"):  # hidden_states: an MTP layer's [1, T, H]
        token_input = placeholders.get(name)
        if token_input is None:
            continue
        users = list(token_input.users)
        with graph.inserting_before(first):
            mine = e(aten.index_select.default, token_input, 1, rows)
        for user in users:
            user.replace_input_with(token_input, mine)
        local_inputs[mine] = token_input
        selected += 1
    if "input_ids" not in placeholders:
        raise VerificationError("split_pcp_prefill needs the 'input_ids' input, which the graph lacks")
    attentions = [n for n in graph.nodes if n.op == "call_function" and n.target in (ATTENTION, SPARSE, COMPRESSED)]
    sparse = [n for n in attentions if n.target is SPARSE]
    compressed = _gather_compressed(graph, e, local_inputs, rows, order, mesh.pcp)
    attentions = [n for n in attentions if n.target is not COMPRESSED]
    if len(attentions) + compressed != program.facts.num_layers:
        raise UnsupportedModelError(
            f"{program.facts.architecture}: prefill_context_parallel_size={mesh.pcp} is compiled for attention "
            f"(dense GQA or MLA, sliding-window, soft-capped, sink or chunked, sparse SFA/DSA, or compressed "
            f"CSA/HCA) in every layer; {program.facts.num_layers - len(attentions) - compressed} of {program.facts.num_layers} layers have none "
            "(layers without attention are not split over PCP ranks); use pcp=1")
    if sparse and queries != "step":
        raise VerificationError(f"split_pcp_prefill: sparse (SFA) attention gathers every step query (queries='step', "
                                f"not {queries!r})")
    indexers: list = []  # gathered once each, in graph order (a shared-indexer layer reads an earlier one)
    for node in attentions:
        if any(len(x.meta["val"].shape) != 4 or x.meta["val"].shape[0] != 1 for x in node.args[:3]):
            raise VerificationError(f"{node.name}: PCP splits [1, H, T, D] attention operands, got "
                                    f"{[tuple(x.meta['val'].shape) for x in node.args[:3]]}")
        q, k, v = node.args[:3]
        with graph.inserting_before(node):
            if node.target is SPARSE and node.args[3] not in indexers:
                indexers.append(node.args[3])
                _gather_indexer(graph, e, node.args[3], order, mesh.pcp)
            gathered_k = _gather_heads_first(graph, e, k, order, mesh.pcp)
            gathered_v = (gathered_k if v is k else _value_of(e, k, v, gathered_k)
                          or _gather_heads_first(graph, e, v, order, mesh.pcp))
            if not local_queries:
                q = _gather_heads_first(graph, e, q, order, mesh.pcp)
            if group_rows is not None:
                q = e(aten.index_select.default, q, 2, group_rows)
        node.args = (q, gathered_k, gathered_v, *node.args[3:])
        if local_queries:
            continue
        users = list(node.users)
        with graph.inserting_after(node):
            back = e(aten.index_select.default, node, 2, rows if own_in_group is None else own_in_group)
        for user in users:
            user.replace_input_with(node, back)
    linear = find_logits_linear(graph)
    with graph.inserting_before(linear):
        hidden = linear.args[0]
        flat = e(aten.clone.default, e(aten.squeeze.dim, hidden, 0), memory_format=torch.contiguous_format)
        step = e(aten.unsqueeze.default, _gather_rows(graph, e, flat, order, mesh.pcp), 0)
    linear.args = (step, *linear.args[1:])
    hidden_output = program.lowering.hidden_states_output
    if hidden_output is not None:  # an MTP layer's own state x [1, L, H]: every row, for chaining drafts
        out = output_node(graph)
        outputs = list(_outputs(graph))
        with graph.inserting_before(out):
            outputs[hidden_output] = _gather_tokens_first(graph, e, outputs[hidden_output], order, mesh.pcp)
        out.args = (tuple(outputs),)
    graph.eliminate_dead_code()
    gm.recompile()
    inputs = (*program.inputs, InputSpec("pcp_rows", RANK, "pcp_rows"), InputSpec("pcp_order", META, "pcp_order"))
    if queries == "group":
        inputs = (*inputs, InputSpec("pcp_group_rows", RANK, "pcp_group_rows"),
                  InputSpec("pcp_own_in_group", RANK, "pcp_own_in_group"))
    gathered = {"rank": "k/v (queries stay local)", "step": "q/k/v",
                "group": "q/k/v (queries read at the DCP group's rows)"}[queries]
    indexed = f", {len(indexers)} indexers' q/k/weights" if indexers else ""
    indexed += f", {compressed} compressed layers' compressor, indexer and attention operands" if compressed else ""
    state = f", hidden-states output {hidden_output}" if hidden_output is not None else ""
    return (program.replace(graph_module=gm, inputs=inputs),
            f"pcp={mesh.pcp}: {selected} token inputs read at pcp_rows; {len(attentions)} attentions' {gathered}"
            f"{indexed}{state} and the LM head's input all-gathered over the PCP group")


def _outputs(graph) -> tuple:
    """The graph's outputs as a tuple."""
    outputs = output_node(graph).args[0]
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def _ensures_local(program: Program) -> None:
    for read in nodes_calling(program.graph_module.graph, PAGED):
        if read.args[4].name not in ("pcp_cu_seqlens_q", "pcp_group_cu_seqlens_q"):
            raise VerificationError(f"{read.name} reads rank-local queries with the step's request boundaries")


@program_pass(
    "split_pcp_attention",
    requires=["split_pcp_prefill", "fuse_new_tokens",
              not_yet_run("shard_dcp", "it applies at dcp = 1 only, where no DCP lowering follows")],
    ensures=[_ensures_local],
)
def split_pcp_attention(program: Program, queries: str = "rank"):
    """After ``split_pcp_prefill(queries="rank")``: each fused paged read takes this rank's
    ``L`` queries, so its query boundaries become ``pcp_cu_seqlens_q`` and its causal bounds
    (``position + 1`` of every step row) and window or chunk starts (``kv_start``, per query) are
    read at ``pcp_rows``; a soft-cap and a sink are per head, the same for every row. Its key counts (context plus the
    request's new tokens, all written to the cache from the gathered K/V) stay the step's. Each
    rank then attends only its zigzag rows: the causal work splits ``1/pcp``. After
    ``split_pcp_prefill(queries="group")`` the same holds for the DCP group's rows
    (``pcp_group_cu_seqlens_q``, bounds at ``pcp_group_rows``): each of the ``dcp`` ranks of the
    group attends the group's ``dcp·L`` rows over its ``1/dcp`` of the keys, again ``1/pcp``."""
    if queries not in ("rank", "group"):
        raise ValueError(f"split_pcp_attention reads 'rank' or 'group' rows, got {queries!r}")
    gm = program.copy_graph()
    graph = gm.graph
    e = Emitter(graph)
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    cu_name, rows_name = (("pcp_cu_seqlens_q", "pcp_rows") if queries == "rank"
                          else ("pcp_group_cu_seqlens_q", "pcp_group_rows"))
    (cu,) = add_placeholders(graph, [cu_name])
    local: dict = {}

    def mine(per_query):
        """``per_query [T]`` at the rows this rank attends, emitted once per node."""
        if per_query not in local:
            with graph.inserting_after(per_query):
                local[per_query] = e(aten.index_select.default, per_query, 0, placeholders[rows_name])
        return local[per_query]

    reads = nodes_calling(graph, PAGED)
    for read in reads:
        bound = read.args[6]
        if bound is None:
            raise VerificationError(f"{read.name} has no causal bound: split_pcp_attention needs fuse_new_tokens' read")
        start = read.args[8] if len(read.args) > 8 else read.kwargs.get("kv_start")
        if "kv_start" in read.kwargs:
            raise VerificationError(f"{read.name}: split_pcp_attention reads kv_start positionally")
        tail = (*read.args[7:8], mine(start), *read.args[9:]) if start is not None else read.args[7:]
        read.args = (*read.args[:4], cu, read.args[5], mine(bound), *tail)
    gm.recompile()
    inputs = (*program.inputs, InputSpec(cu_name, RANK, cu_name))
    whose = "this rank's rows" if queries == "rank" else "the DCP group's rows"
    return (program.replace(graph_module=gm, inputs=inputs),
            f"{len(reads)} paged reads attend {whose} only ({cu_name}, bounds at {rows_name})")


def _gather_rows(graph, e: Emitter, x, order, pcp: int):
    """``x [L, ...]`` of every PCP rank, in step order ``[T, ...]``."""
    return e(aten.index_select.default, coll.all_gather(graph, x, pcp, "pcp"), 0, order)


def _gather_heads_first(graph, e: Emitter, x, order, pcp: int):
    """``x [1, H, L, D]`` of every PCP rank as ``[1, H, T, D]`` in step order."""
    tokens_first = e(aten.clone.default, e(aten.transpose.int, e(aten.squeeze.dim, x, 0), 0, 1),
                     memory_format=torch.contiguous_format)  # [L, H, D]
    return e(aten.unsqueeze.default, e(aten.transpose.int, _gather_rows(graph, e, tokens_first, order, pcp), 0, 1), 0)


def _value_of(e: Emitter, k, v, gathered_k):
    """MLA's latent value is a slice of its key (``v = k[..., a:b]``): the same slice of the gathered
    key, so it is not exchanged twice; None when ``v`` is a tensor of its own."""
    if not (v.op == "call_function" and v.target is aten.slice.Tensor and v.args[0] is k and v.args[1] in (-1, 3)):
        return None
    return e(aten.slice.Tensor, gathered_k, *v.args[1:])


def _gather_indexer(graph, e: Emitter, indexer, order, pcp: int) -> None:
    """Gather a canonical ``indexer_topk(q [1, S, Hi, D], k [1, T, D], weights [1, S, Hi], ...)``'s
    token-major operands over the PCP group (in place): every rank then scores every step query
    against every step key, so its top-k is the ``pcp = 1`` selection of every row."""
    iq, ik, w = indexer.args[:3]
    for x in (iq, ik, w):
        if x.meta["val"].shape[0] != 1:
            raise VerificationError(f"{indexer.name}: PCP splits [1, T, ...] indexer operands, got "
                                    f"{tuple(x.meta['val'].shape)}")
    with graph.inserting_before(indexer):
        step = [_gather_tokens_first(graph, e, x, order, pcp) for x in (iq, ik, w)]
    indexer.args = (*step, *indexer.args[3:])


def _gather_tokens_first(graph, e: Emitter, x, order, pcp: int):
    """``x [1, L, ...]`` of every PCP rank as ``[1, T, ...]`` in step order."""
    rows = e(aten.clone.default, e(aten.squeeze.dim, x, 0), memory_format=torch.contiguous_format)
    return e(aten.unsqueeze.default, _gather_rows(graph, e, rows, order, pcp), 0)


def _gather_compressed(graph, e: Emitter, local_inputs: dict, rows, order, pcp: int) -> int:
    """DeepSeek-V4's compressed layers, computed on the whole step on every PCP rank (in place).

    A compressor's windows span the PCP ranks' rows and its open window is per-request state, so
    each ``compress_windows(kv [1, L, w], gate [1, L, w], ...)`` gets both inputs gathered in step
    order and pools every step row as ``pcp = 1`` does (every rank then writes the same open
    window); its row-form output is read back at ``pcp_rows``, where the entries' norm and compress
    rotary run row-wise. Each ``compressed_topk`` (CSA's indexer: query, head weights, keys) and
    ``compressed_attention`` (query, the K=V head, the entries) gets its operands gathered the same
    way and its positions as the step's ``position_ids``, so every rank selects and attends every
    row exactly as ``pcp = 1``; the selection feeds the gathered attention directly, and the
    attention's output is read back at ``pcp_rows``. Returns the number of compressed attentions."""
    def step_positions(x):
        if x in local_inputs:
            return local_inputs[x]  # position_ids read at pcp_rows: the step's own input
        return _gather_tokens_first(graph, e, x, order, pcp)

    for node in nodes_calling(graph, COMPRESS):
        with graph.inserting_before(node):
            step = [_gather_tokens_first(graph, e, x, order, pcp) for x in node.args[:2]]
        node.args = (*step, *node.args[2:])
        _read_back(graph, e, node, 1, rows, keep=())
    for node in nodes_calling(graph, COMPRESSED_TOPK):
        iq, weights, keys, positions = node.args[:4]
        with graph.inserting_before(node):
            step = [_gather_tokens_first(graph, e, x, order, pcp) for x in (iq, weights, keys)]
            node.args = (*step, step_positions(positions), *node.args[4:])
        _read_back(graph, e, node, 1, rows, keep=(COMPRESSED,))
    attentions = nodes_calling(graph, COMPRESSED)
    for node in attentions:
        q, kv, entries, positions = node.args[:4]
        with graph.inserting_before(node):
            step = [_gather_heads_first(graph, e, q, order, pcp), _gather_heads_first(graph, e, kv, order, pcp),
                    _gather_tokens_first(graph, e, entries, order, pcp), step_positions(positions)]
        node.args = (*step, *node.args[4:])
        _read_back(graph, e, node, 2, rows, keep=())
    return len(attentions)


def _read_back(graph, e: Emitter, node, dim: int, rows, keep: tuple) -> None:
    """Users of ``node`` (a step-order ``T``-row result) other than calls of ``keep`` read it at
    ``rows`` along ``dim``."""
    users = [u for u in node.users if not (u.op == "call_function" and u.target in keep)]
    if not users:
        return
    with graph.inserting_after(node):
        back = e(aten.index_select.default, node, dim, rows)
    for user in users:
        user.replace_input_with(node, back)
