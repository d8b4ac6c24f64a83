"""``layer_group_tables``: sliding-window layers read and write their caches through their own
block table, so their caches can be sized for the window instead of the whole context.

A compiled program addresses every cache with one ``block_table`` (reads) and one
``slot_mapping`` (writes). A sliding layer with window ``W`` never reads a key more than ``W − 1``
positions before its query (``kv_start``, see ``insert_kv_cache``), so once a request has computed
``c`` tokens the virtual blocks wholly before ``c − W + 1`` are dead for it. This pass gives the
sliding layers (every paged read with a ``kv_start``) the inputs ``block_table_sliding`` and
``slot_mapping_sliding``; the runtime (:class:`~dcpgraph.runtime.layer_groups.HybridBlockManager`)
then hands those layers a table in which dead virtual blocks point at a never-written null block
and are returned to a separate, smaller pool. The kernels are unchanged: a paged read gathers
the row's blocks up to its length and masks keys before ``kv_start``, so the null block's
(finite, zero) values are never weighted. Under DCP a virtual block is one physical block on
every rank of the group and covers a contiguous range of global positions, so a block dead for
the window is dead on every rank, whatever part of it each rank holds.

Cache names of the sliding group go to ``Lowering.sliding_caches``, the largest window to
``Lowering.sliding_window`` (what the runtime sizes and frees by).
"""

from __future__ import annotations

import torch

from ..capacity import SCALE_SUFFIX
from ..errors import ConfigError
from ..ops import compressed_cached as _cached_ops  # noqa: F401  (registers the cached forms)
from ..ops import compressed_dcp as _dcp_ops  # noqa: F401  (registers the DCP forms)
from ..program import META, InputSpec, Program
from .graph_edit import add_placeholders, nodes_calling
from .manager import program_pass, ran

dcp_ops = torch.ops.dcpgraph

SLIDING_ROLES = ("block_table_sliding", "slot_mapping_sliding")
_TABLE_ARG, _WINDOW_START_ARG = 3, 8  # paged_attention(q, k, v, block_table, cu, lens, bound, scale, kv_start, …)
# compressed_attention(q, kv, entries, positions, sinks, scale, window, …) and its cached forms:
# compressed_attention_(q, kv, entries, positions, sinks, kv_cache, entry_cache, block_table, window_table, …)
# compressed_attention_dcp_(q, kv, entries, positions, kv_cache, entry_cache, block_table, window_table, …)
_COMPRESSED_WINDOW_ARG = 6
_RAW_ARGS = {dcp_ops.compressed_attention_.default: (5, 8),  # (raw cache, window table) argument indices
             dcp_ops.compressed_attention_dcp_.default: (4, 7)}
_WRITES = (dcp_ops.kv_cache_write_.default, dcp_ops.kv_cache_write_fp8_.default)


def _cache_placeholder(node: torch.fx.Node) -> torch.fx.Node:
    """The cache placeholder behind a paged read's cache argument (MLA values are a slice of it)."""
    while node.op != "placeholder":
        node = node.args[0]
    return node


def model_windows(program: Program) -> tuple[int, ...]:
    """The distinct sliding windows of a traced (canonical) program's attention layers (DeepSeek-V4's
    compressed attentions included: their raw tokens are a sliding window)."""
    from .insert_kv_cache import attention_modifiers

    graph = program.graph_module.graph
    found = {attention_modifiers(n)[0] for n in nodes_calling(graph, dcp_ops.attention.default)}
    found |= {int(n.args[_COMPRESSED_WINDOW_ARG])
              for n in nodes_calling(graph, dcp_ops.compressed_attention.default)}
    return tuple(sorted(w for w in found if w))


@program_pass(
    "layer_group_tables",
    requires=[ran("insert_kv_cache", "it rewires the paged reads and cache writes that pass emits")],
)
def layer_group_tables(program: Program, windows: tuple[int, ...] = ()):
    """``windows``: the model's sliding windows (from the traced canonical attention); the largest
    bounds what a sliding layer keeps."""
    gm = program.copy_graph()
    graph = gm.graph
    reads = [n for n in nodes_calling(graph, dcp_ops.paged_attention.default)
             if len(n.args) > _WINDOW_START_ARG and n.args[_WINDOW_START_ARG] is not None]
    compressed = [n for n in graph.nodes if n.op == "call_function" and n.target in _RAW_ARGS]
    if not (reads or compressed) or not windows:
        raise ConfigError("hybrid_kv_cache=True needs a model with sliding-window layers; this one has none")
    table, slots = add_placeholders(graph, list(SLIDING_ROLES))
    sliding = set()
    for read in reads:
        read.args = (*read.args[:_TABLE_ARG], table, *read.args[_TABLE_ARG + 1:])
        sliding.update(_cache_placeholder(a).name for a in read.args[1:3])
    for read in compressed:  # DeepSeek-V4: the raw window's rows (entries keep the full table), at any dcp
        raw_cache, raw_table = _RAW_ARGS[read.target]
        read.args = (*read.args[:raw_table], table, *read.args[raw_table + 1:])
        sliding.add(read.args[raw_cache].name)
    reads += compressed
    rewired = 0
    for write in (n for target in _WRITES for n in nodes_calling(graph, target)):
        if write.args[0].name in sliding:
            write.args = (*write.args[:2], slots, *write.args[3:])
            rewired += 1
    gm.recompile()
    specs = (*program.inputs, *(InputSpec(r, META, r) for r in SLIDING_ROLES))
    scale_names = {name + SCALE_SUFFIX for name in sliding}
    names = tuple(c.name for c in program.caches if c.name in sliding or c.name in scale_names)
    lowering = program.lowering.decided(sliding_caches=names, sliding_window=max(windows))
    result = program.replace(graph_module=gm, inputs=specs, lowering=lowering)
    return result, (f"{len(reads)} windowed paged reads and {rewired} cache writes -> per-group "
                    f"tables; sliding caches {len(names)} of {len(program.caches)}, window {max(windows)}")
