"""``lower_npu``: rewrite dcpgraph's ops into Ascend/aten ops before torchair's GE mode sees them.

A pure FX pass, ``GraphModule -> new GraphModule``: the input GraphModule (the one
:class:`~dcpgraph.backends.fallback.FallbackGraph` runs eagerly if the compiled graph fails) is
never modified. It works on any per-rank program graph whose nodes carry ``meta["val"]`` (every
verified :class:`~dcpgraph.program.Program` does; for other graphs pass ``example_inputs`` and it
propagates fake values first). It is a GraphModule pass, not a ``program_pass``, because it runs
inside the backend, after the pipeline, on the GraphModule torch.compile is handed; the lowered
graph is only meaningful to torchair (its ops have no CPU kernels), so it never becomes a Program.

torchair's GE ("max-autotune") mode needs a converter for every FX node, and dcpgraph's ops have
none, so nothing dcpgraph-specific may remain. What becomes what (``T`` tokens, ``H`` heads):

===============================  ==================================================================
dcpgraph op                      lowered to
===============================  ==================================================================
``paged_attention``              ``air.npu_fused_infer_attention_score`` (GE ``FusedInferAttention
                                 Score``), ``input_layout="TND"``, paged KV: the cache
                                 ``[NB, B, Hkv, D]`` viewed ``[NB, B, Hkv·D]``, ``block_table``,
                                 ``block_size=B``, ``actual_seq_lengths`` = ``cu_seqlens_q[1:]``
                                 (TND's cumulative query ends), ``actual_seq_lengths_kv`` = the
                                 (local) context lengths per request, ``softmax_lse_flag=True``.
                                 MLA (values a prefix ``[..., :R]`` of the latent key): ``query``/
                                 ``key``/``value`` are the ``R`` latent dims, ``query_rope``/
                                 ``key_rope`` the rest. The lse ``[T, N, 1]`` becomes ``[T, H]``;
                                 rows with no local key are forced to ``(0, −inf)`` in aten (the
                                 merge's neutral element), whatever FIAS returns for them.
``partial_attention``            the same op without paging: TND, ``actual_seq_lengths(_kv)`` =
                                 ``cu_seqlens_q[1:]``/``cu_seqlens_k[1:]``; ``causal`` →
                                 ``sparse_mode=3`` (bottom-right causal) with the 2048×2048 upper-
                                 triangular mask FIAS requires for it; MLA split as above.
``merge_attention``              ``npu.npu_attention_update(lse_list, out_list, update_type)`` when
                                 within its limits: at most 16 partials, value head dim in
                                 [8, 512] and a multiple of 8, outputs fp32/fp16/bf16, lse fp32;
                                 ``update_type=1`` only if the merged lse is used. Around it, aten
                                 applies dcpgraph's edge rules (:mod:`dcpgraph.ops.merge`): NaN/+inf
                                 lse counts as empty, an empty partial's output (maybe NaN) is
                                 zeroed and its lse clamped to −1e30 so the kernel never computes
                                 ``−inf − (−inf)``, and rows where every partial is empty give
                                 ``(0, −inf)``. Outside the limits (e.g. dcp > 16, fp64, Dv = 4):
                                 the merge written in aten (max, exp, sum, log, where).
``rescale_to_global``            aten (the AG+RS merge's local step, same edge rules).
``kv_cache_write_``              aten ``scatter_`` (GE ``ScatterElements``; torchair has no
                                 ``index_put`` converter) along dim 0 of the cache viewed
                                 ``[NB·B, H, D]``, the slot index broadcast over ``H, D``. Slot −1
                                 (a token this DCP rank does not own) must not write: such tokens
                                 are pointed at the first owned token's slot with that token's value
                                 (or, when no token is owned, at slot 0 with slot 0's current
                                 value), so every write to a slot carries the same value and the
                                 result does not depend on scatter order.
===============================  ==================================================================

Collectives stay ``_c10d_functional`` ops: torchair converts them to ``HcomAllGather``,
``HcomAllToAll``/``HcomAllToAllV``, ``HcomReduceScatter``, ``HcomAllReduce``.

Why ``torch.ops.air.npu_fused_infer_attention_score`` and not torch_npu's
``torch.ops.npu.npu_fused_infer_attention_score``: both convert to the same GE op, but torch_npu's
takes ``actual_seq_lengths(_kv)`` as a host ``SymInt[]``, while dcpgraph's lengths are per-step
tensor inputs (``local_context_lens``): turning them into SymInts needs
``aten._local_scalar_dense``, which torchair cannot convert (and a list would bake the batch size
into the graph). torchair's own overload (``torchair.ops.npu_fused_infer_attention_score``,
documented as graph-mode only) takes them as int64 device tensors. Both ops are looked up lazily,
inside the pass: on Ascend ``torch.ops.npu.*`` come from libtorch_npu.so and ``torch.ops.air.*``
from importing torchair; where they are missing (and no test tier declared them) the pass raises
:class:`NpuLoweringError` naming what is missing. The merge, rescale and KV-write lowerings are
plain aten and need neither.

Limits (checked here, or inherited from the ops; the FIAS ones are not checked by conversion and
would fail in CANN's compile on the device):

- ``npu_attention_update``: ≤ 16 partials (so dcp ≤ 16 on the a2a path; the final two-way
  context/new merge always fits), Dv ∈ [8, 512] with Dv % 8 == 0; otherwise the aten merge.
- FIAS: query fp16/bf16 (fp32 is accepted by conversion but not listed as supported by the kernel;
  fp64 is refused here), ``num_heads / num_key_value_heads`` ≤ 64, paged ``block_size`` a
  multiple of 128 in [128, 512] for GQA (MLA: 128), MLA only with latent 512 + rope 64 and one KV
  head (DeepSeek's shapes; dcpgraph's tiny test models use 32 + 8), A2/A3 hardware.
- ``paged_attention``'s optional ``kv_bound`` (a per-query causal bound inside the cache) has no
  FIAS form here and raises :class:`NpuLoweringError` (no dcpgraph pass emits it today).

Checked on CPU by ``tests/torchair_tier``: conversion of DCP decode programs (GQA and MLA, a2a and
ag_rs) succeeds with every node converted, which GE ops come out, and the lowered graph run with
CPU reference kernels of FIAS/AttentionUpdate (written from their documentation) reproduces eager's
logits and caches — including requests with no local keys, slot −1 writes and all-empty merges.
Unverified without Ascend hardware: FIAS's numerics and its output for requests with zero local keys (masked here
anyway); that TND ``actual_seq_lengths_kv`` is per-request for paged KV and cumulative without
paging (as the FIAS documentation describes); that non-paged TND accepts ``query_rope``;
AttentionUpdate's numerics; and performance: the MLA latent cache is one tensor ``[c ‖ k_rope]``,
so the ``c``/``k_rope`` slices handed to FIAS are strided views that GE may materialise as copies
of the whole cache each step (vLLM-Ascend keeps two caches for this reason); a KV write through
``scatter_`` on a graph input is functionalised by AOT autograd (torchair keeps input mutations
in the graph by default), not a dedicated scatter-to-cache kernel (torchair does convert
``npu_scatter_pa_kv_cache``; it is not used because its handling of slot −1 is unchecked). The KV-write
lowering assumes a step has at least one token (as every dcpgraph step does).
"""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Sequence

import torch
import torch.fx

aten = torch.ops.aten
dcp_ops = torch.ops.dcpgraph

NEG_INF = float("-inf")
# An empty partial's lse as handed to npu_attention_update: finite, so max/exp never see
# −inf − (−inf), and small enough that exp(lse − max) is exactly 0 next to any real lse.
EMPTY_LSE = -1e30
FIAS_MASK_SIZE = 2048  # sparse_mode 3 takes a fixed 2048×2048 upper-triangular mask
UPDATE_MAX_PARTIALS = 16
UPDATE_HEAD_DIM = (8, 512, 8)  # min, max, multiple
UPDATE_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FIAS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MERGE_MODES = ("auto", "npu", "aten")

_VIEW_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
    aten.permute.default, aten.select.int, aten.unsqueeze.default, aten.squeeze.dim,
    aten.expand.default, aten.alias.default, aten.clone.default, aten.contiguous.default,
}


class NpuLoweringError(RuntimeError):
    """The graph cannot be lowered for GE (missing Ascend ops, or an unsupported dcpgraph form)."""


# -- op lookup (lazy) -----------------------------------------------------------------------------
def _has_op(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def fias_op():
    """``torch.ops.air.npu_fused_infer_attention_score.default`` (registered by torchair)."""
    if not _has_op("air", "npu_fused_infer_attention_score"):
        try:  # torchair registers it when this module is imported (lazily, by its ops package)
            import torchair.ops._npu_fused_infer_attention_score  # noqa: F401
        except Exception as err:  # noqa: BLE001 - any failure means the op is unavailable
            raise NpuLoweringError(
                "torch.ops.air.npu_fused_infer_attention_score is not registered: it comes with "
                "torchair (import torch_npu, then torchair, on an Ascend machine with CANN); "
                f"importing it failed: {type(err).__name__}: {err}"
            ) from err
    return torch.ops.air.npu_fused_infer_attention_score.default


def attention_update_op():
    """``torch.ops.npu.npu_attention_update.default`` (registered by libtorch_npu.so)."""
    if not _has_op("npu", "npu_attention_update"):
        raise NpuLoweringError(
            "torch.ops.npu.npu_attention_update is not registered: it comes from torch_npu "
            "(libtorch_npu.so); import torch_npu on an Ascend machine, or lower with merge='aten'"
        )
    return torch.ops.npu.npu_attention_update.default


# -- the pass -------------------------------------------------------------------------------------
def lower_npu(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence | None = None,
    *,
    merge: str = "auto",
) -> torch.fx.GraphModule:
    """A new GraphModule with every dcpgraph op replaced (see the module docstring).

    ``merge``: ``"auto"`` uses ``npu_attention_update`` where its limits allow and the aten merge
    elsewhere; ``"npu"`` requires it everywhere (raises otherwise); ``"aten"`` never uses it.
    """
    if merge not in MERGE_MODES:
        raise ValueError(f"merge must be one of {MERGE_MODES}, got {merge!r}")
    new = _copy(gm)
    if example_inputs is not None and not _has_meta(new):
        _propagate(new, example_inputs)
    graph = new.graph
    lowering = _Lowering(graph, merge)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        rule = lowering.rules.get(node.target)
        if rule is not None:
            rule(node)
    lowering.remove_dead()
    left = [n.name for n in graph.nodes if n.op == "call_function" and _is_dcpgraph_op(n.target)]
    if left:
        raise NpuLoweringError(f"dcpgraph ops left after lower_npu (no lowering rule): {left}")
    graph.lint()
    new.recompile()
    new.meta["lower_npu"] = dict(lowering.counts)
    return new


def _is_dcpgraph_op(target) -> bool:
    return getattr(target, "namespace", None) == "dcpgraph"


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    value_map: dict[torch.fx.Node, torch.fx.Node] = {}
    out = graph.graph_copy(gm.graph, value_map)
    graph.output(out)
    for old, new in value_map.items():
        new.meta = copy.copy(old.meta)
    return torch.fx.GraphModule(gm, graph)


def _has_meta(gm: torch.fx.GraphModule) -> bool:
    return all("val" in n.meta for n in gm.graph.nodes
               if n.op == "call_function" and _is_dcpgraph_op(n.target))


def _propagate(gm: torch.fx.GraphModule, example_inputs: Sequence) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in example_inputs]

        class _Prop(torch.fx.Interpreter):
            def run_node(self, n):
                result = super().run_node(n)
                n.meta["val"] = result
                return result

        _Prop(gm).run(*args)


def _val(node) -> torch.Tensor:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else node
    if not isinstance(value, torch.Tensor):
        raise NpuLoweringError(f"{getattr(node, 'name', node)} has no tensor meta['val']: run shape "
                               "propagation (pass example_inputs) before lower_npu")
    return value


def _strip_views(node):
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _VIEW_OPS:
        node = node.args[0]
    return node


def _latent_prefix(k: torch.fx.Node, v: torch.fx.Node) -> int:
    """``R`` when ``v`` is ``k[..., :R]`` up to the same leading-dim views (MLA latent form)."""
    kv, vv = _val(k), _val(v)
    if kv.shape[:-1] != vv.shape[:-1] or vv.shape[-1] >= kv.shape[-1]:
        return 0
    node = v
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target is aten.slice.Tensor:
            src = node.args[0]
            dim = node.args[1] if len(node.args) > 1 else 0
            start = node.args[2] if len(node.args) > 2 else 0
            if dim in (-1, _val(src).dim() - 1) and start in (0, None) and _strip_views(src) is _strip_views(k):
                return int(vv.shape[-1])
            return 0
        if node.target not in _VIEW_OPS:
            return 0
        node = node.args[0]
    return 0


class _Lowering:
    def __init__(self, graph: torch.fx.Graph, merge: str):
        self.graph = graph
        self.merge = merge
        self.created: list[torch.fx.Node] = []
        self.counts: dict[str, int] = {}
        self.rules = {
            dcp_ops.kv_cache_write_.default: self.kv_cache_write,
            dcp_ops.paged_attention.default: self.paged_attention,
            dcp_ops.partial_attention.default: self.partial_attention,
            dcp_ops.merge_attention.default: self.merge_attention,
            dcp_ops.rescale_to_global.default: self.rescale_to_global,
        }

    # -- emission helpers ----------------------------------------------------------------------
    def __call__(self, target, *args, **kwargs) -> torch.fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        self.created.append(node)
        return node

    def item(self, node, index: int) -> torch.fx.Node:
        return self(operator.getitem, node, index)

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def cast(self, node, dtype: torch.dtype) -> torch.fx.Node:
        return self(aten._to_copy.default, node, dtype=dtype)

    def where(self, cond, a, b) -> torch.fx.Node:
        """``where`` with either branch a tensor node or a Python scalar."""
        a_scalar = not isinstance(a, torch.fx.Node)
        b_scalar = not isinstance(b, torch.fx.Node)
        if a_scalar and b_scalar:
            raise ValueError("where needs at least one tensor branch")
        if b_scalar:
            return self(aten.where.ScalarOther, cond, a, b)
        if a_scalar:
            return self(aten.where.ScalarSelf, cond, a, b)
        return self(aten.where.self, cond, a, b)

    def sanitize(self, lse, dtype: torch.dtype) -> torch.fx.Node:
        """lse in ``dtype`` with NaN and +inf mapped to −inf (an empty partial)."""
        lse = self.cast(lse, dtype)
        # ``lse < inf`` is False exactly for NaN and +inf (torchair has no isnan converter).
        return self.where(self(aten.lt.Scalar, lse, math.inf), lse, NEG_INF)

    def replace(self, node: torch.fx.Node, results: Sequence[torch.fx.Node | None]) -> None:
        """Route ``node``'s getitem users to ``results`` and erase it."""
        for user in list(node.users):
            if user.op != "call_function" or user.target is not operator.getitem:
                raise NpuLoweringError(f"{node.name} is used by {user.name} other than through getitem")
            result = results[user.args[1]]
            if result is None:
                raise NpuLoweringError(f"{node.name}[{user.args[1]}] is used but not produced")
            user.replace_all_uses_with(result)
            self.graph.erase_node(user)
        self.graph.erase_node(node)

    def used(self, node: torch.fx.Node, index: int) -> bool:
        return any(u.target is operator.getitem and u.args[1] == index for u in node.users)

    def remove_dead(self) -> None:
        """Drop nodes this pass created that ended up unused (e.g. an lse nobody reads)."""
        alive = set(self.graph.nodes)
        changed = True
        while changed:
            changed = False
            for node in reversed(self.created):
                if node in alive and not node.users and not _mutates(node):
                    self.graph.erase_node(node)
                    alive.discard(node)
                    changed = True

    # -- kv_cache_write_ -----------------------------------------------------------------------
    def kv_cache_write(self, node: torch.fx.Node) -> None:
        cache, new, slots = node.args
        cache_val = _val(cache)
        inner = list(cache_val.shape[2:])
        with self.graph.inserting_before(node):
            flat = self(aten.view.default, cache, [-1, *inner])
            slots64 = self.cast(slots, torch.int64)
            owned = self(aten.ge.Scalar, slots64, 0)
            first = self(aten.view.default, self(aten.argmax.default, self.cast(owned, torch.int32), 0), [1])
            any_owned = self(aten.index_select.default, owned, 0, first)  # [1]
            fallback = self.where(any_owned, self(aten.index_select.default, slots64, 0, first), 0)
            index = self(aten.where.self, owned, slots64, fallback)  # [T]
            values = self.cast(new, cache_val.dtype)
            bcast = [-1] + [1] * len(inner)
            fallback_value = self(
                aten.where.self, self(aten.view.default, any_owned, bcast),
                self(aten.index_select.default, values, 0, first),
                self(aten.index_select.default, flat, 0, fallback),
            )
            values = self(aten.where.self, self(aten.view.default, owned, bcast), values, fallback_value)
            # scatter_ (ScatterElements in GE; torchair has no converter for index_put) needs the
            # index at the values' shape: the slot broadcast over the trailing dims.
            index = self(aten.expand.default, self(aten.view.default, index, bcast), [-1, *inner])
            self(aten.scatter_.src, flat, 0, index, values)
        if node.users:
            raise NpuLoweringError(f"{node.name} (kv_cache_write_) has users")
        self.graph.erase_node(node)
        self.count("kv_cache_write_->scatter_")

    # -- attention -----------------------------------------------------------------------------
    def _check_dtype(self, node, q) -> None:
        dtype = _val(q).dtype
        if dtype not in FIAS_DTYPES:
            raise NpuLoweringError(f"{node.name}: FusedInferAttentionScore has no {dtype} form "
                                   "(build the program in bf16/fp16)")

    def _fias(self, node, q, key, value, *, query_rope=None, key_rope=None, **options):
        q_val = _val(q)
        result = self(
            fias_op(), q if query_rope is None else query_rope[0], key, value,
            query_rope=None if query_rope is None else query_rope[1], key_rope=key_rope,
            num_heads=int(q_val.shape[1]), input_layout="TND", softmax_lse_flag=True, **options,
        )
        out = self.item(result, 0)
        lse = self(aten.squeeze.dim, self.item(result, 1), -1)  # [T, N, 1] -> [T, N]
        out_val, lse_val = node.meta["val"]
        if out_val.dtype != q_val.dtype:
            out = self.cast(out, out_val.dtype)
        return out, self.cast(lse, lse_val.dtype)

    def _mask_empty_rows(self, out, lse, q, cu_q, kv_lens):
        """Rows whose request has no (local) key: out 0, lse −inf, whatever FIAS gave."""
        # positions 0..T-1 on q's device (an arange would bake the tracing device into the graph)
        ones = self(aten.ones_like.default, self(aten.select.int, self(aten.select.int, q, -1, 0), -1, 0),
                    dtype=torch.int64)  # [T]
        positions = self(aten.sub.Tensor, self(aten.cumsum.default, ones, 0), ones)
        ends = self(aten.slice.Tensor, self.cast(cu_q, torch.int64), 0, 1, None)
        row = self(aten.sum.dim_IntList, self.cast(self(aten.ge.Tensor, self(aten.unsqueeze.default, positions, 1),
                                                        self(aten.unsqueeze.default, ends, 0)), torch.int64), [1])
        has_keys = self(aten.gt.Scalar, self(aten.index_select.default, kv_lens, 0, row), 0)  # [T]
        out = self.where(self(aten.view.default, has_keys, [-1, 1, 1]), out, 0.0)
        lse = self.where(self(aten.view.default, has_keys, [-1, 1]), lse, NEG_INF)
        return out, lse

    def paged_attention(self, node: torch.fx.Node) -> None:
        q, k_cache, v_cache, table, cu_q, kv_lens, kv_bound, scale = node.args
        if kv_bound is not None:
            raise NpuLoweringError(f"{node.name}: paged_attention with kv_bound has no FIAS lowering")
        self._check_dtype(node, q)
        kc = _val(k_cache)
        block, kv_heads, dk = int(kc.shape[1]), int(kc.shape[2]), int(kc.shape[3])
        latent = _latent_prefix(k_cache, v_cache)
        with self.graph.inserting_before(node):
            lengths = dict(
                actual_seq_lengths=self.cast(self(aten.slice.Tensor, cu_q, 0, 1, None), torch.int64),
                actual_seq_lengths_kv=self.cast(kv_lens, torch.int64),
                block_table=table if _val(table).dtype == torch.int32 else self.cast(table, torch.int32),
            )
            common = dict(scale=float(scale), num_key_value_heads=kv_heads, block_size=block, sparse_mode=0)
            if latent:
                rope = dk - latent
                q_nope = self(aten.slice.Tensor, q, -1, 0, latent)
                q_rope = self(aten.slice.Tensor, q, -1, latent, dk)
                c = self(aten.reshape.default, self(aten.slice.Tensor, k_cache, -1, 0, latent), [-1, block, kv_heads * latent])
                k_rope = self(aten.reshape.default, self(aten.slice.Tensor, k_cache, -1, latent, dk), [-1, block, kv_heads * rope])
                out, lse = self._fias(node, q, c, c, query_rope=(q_nope, q_rope), key_rope=k_rope, **lengths, **common)
                self.count("paged_attention(mla)->FIAS")
            else:
                dv = int(_val(v_cache).shape[-1])
                key = self(aten.reshape.default, k_cache, [-1, block, kv_heads * dk])
                value = self(aten.reshape.default, v_cache, [-1, block, kv_heads * dv])
                out, lse = self._fias(node, q, key, value, **lengths, **common)
                self.count("paged_attention->FIAS")
            out, lse = self._mask_empty_rows(out, lse, q, cu_q, kv_lens)
        self.replace(node, (out, lse))

    def partial_attention(self, node: torch.fx.Node) -> None:
        q, k, v, cu_q, cu_k, scale, causal = node.args
        self._check_dtype(node, q)
        kv_heads, dk = int(_val(k).shape[1]), int(_val(k).shape[2])
        latent = _latent_prefix(k, v)
        with self.graph.inserting_before(node):
            options = dict(
                actual_seq_lengths=self.cast(self(aten.slice.Tensor, cu_q, 0, 1, None), torch.int64),
                actual_seq_lengths_kv=self.cast(self(aten.slice.Tensor, cu_k, 0, 1, None), torch.int64),
                scale=float(scale), num_key_value_heads=kv_heads,
            )
            if causal:
                ones = self(aten.new_ones.default, q, [FIAS_MASK_SIZE, FIAS_MASK_SIZE], dtype=torch.bool)
                options.update(sparse_mode=3, atten_mask=self(aten.triu.default, ones, 1))
            else:
                options.update(sparse_mode=0)
            if latent:
                q_parts = (self(aten.slice.Tensor, q, -1, 0, latent), self(aten.slice.Tensor, q, -1, latent, dk))
                c = self(aten.slice.Tensor, k, -1, 0, latent)
                k_rope = self(aten.slice.Tensor, k, -1, latent, dk)
                out, lse = self._fias(node, q, c, c, query_rope=q_parts, key_rope=k_rope, **options)
                self.count("partial_attention(mla)->FIAS")
            else:
                out, lse = self._fias(node, q, k, v, **options)
                self.count("partial_attention->FIAS")
        self.replace(node, (out, lse))

    # -- merges --------------------------------------------------------------------------------
    def _update_fits(self, outs_val: torch.Tensor, lses_val: torch.Tensor) -> str | None:
        """None when npu_attention_update can do this merge, else why not."""
        n, dv = int(outs_val.shape[0]), int(outs_val.shape[-1])
        low, high, multiple = UPDATE_HEAD_DIM
        if n > UPDATE_MAX_PARTIALS:
            return f"{n} partials > {UPDATE_MAX_PARTIALS}"
        if not (low <= dv <= high and dv % multiple == 0):
            return f"value head dim {dv} outside [{low}, {high}] or not a multiple of {multiple}"
        if outs_val.dtype not in UPDATE_OUT_DTYPES:
            return f"output dtype {outs_val.dtype}"
        if lses_val.dtype == torch.float64:
            return "fp64 lse (the op's lse is fp32)"
        return None

    def merge_attention(self, node: torch.fx.Node) -> None:
        outs, lses = node.args
        outs_val, lses_val = _val(outs), _val(lses)
        why_not = self._update_fits(outs_val, lses_val)
        if self.merge == "npu" and why_not:
            raise NpuLoweringError(f"{node.name}: npu_attention_update cannot merge: {why_not}")
        use_npu = self.merge != "aten" and why_not is None
        with self.graph.inserting_before(node):
            if use_npu:
                out, lse = self._merge_npu(node, outs, lses, outs_val)
                self.count("merge_attention->npu_attention_update")
            else:
                out, lse = self._merge_aten(outs, lses, outs_val, _val(node.meta["val"][1]).dtype)
                self.count("merge_attention->aten")
        self.replace(node, (out, lse))

    def _merge_npu(self, node, outs, lses, outs_val):
        n, dv = int(outs_val.shape[0]), int(outs_val.shape[-1])
        rows = list(outs_val.shape[1:-1])  # e.g. [T, H]
        lse32 = self.cast(lses, torch.float32)
        valid = self(aten.logical_and.default, self(aten.gt.Scalar, lse32, NEG_INF), self(aten.lt.Scalar, lse32, math.inf))
        lse_c = self.where(valid, lse32, EMPTY_LSE)
        out_c = self.where(self(aten.unsqueeze.default, valid, -1), outs, 0.0)
        lse_list = [self(aten.reshape.default, self(aten.select.int, lse_c, 0, i), [-1]) for i in range(n)]
        out_list = [self(aten.reshape.default, self(aten.select.int, out_c, 0, i), [-1, dv]) for i in range(n)]
        want_lse = self.used(node, 1)
        result = self(attention_update_op(), lse_list, out_list, 1 if want_lse else 0)
        any_valid = self(aten.any.dim, valid, 0)  # [T, H]
        shape = [-1, *rows[1:]]
        out = self(aten.reshape.default, self.item(result, 0), [*shape, dv])
        out = self.where(self(aten.unsqueeze.default, any_valid, -1), out, 0.0)
        lse = None
        if want_lse:
            lse = self(aten.reshape.default, self.item(result, 1), shape)
            lse = self.cast(self.where(any_valid, lse, NEG_INF), _val(node.meta["val"][1]).dtype)
        return out, lse

    def _weights(self, lses, dtype):
        """dcpgraph.ops.merge.merge_weights in aten: (weights [N, ...], lse [...])."""
        lses = self.sanitize(lses, dtype)
        peak = self.item(self(aten.max.dim, lses, 0, True), 0)  # (torchair has no amax converter)
        peak = self.where(self(aten.eq.Scalar, peak, NEG_INF), 0.0, peak)
        scaled = self(aten.exp.default, self(aten.sub.Tensor, lses, peak))
        total = self(aten.sum.dim_IntList, scaled, [0], True)
        nonempty = self(aten.gt.Scalar, total, 0)
        safe_total = self.where(nonempty, total, 1.0)
        weights = self.where(nonempty, self(aten.div.Tensor, scaled, safe_total), 0.0)
        lse = self.where(nonempty, self(aten.add.Tensor, peak, self(aten.log.default, safe_total)), NEG_INF)
        return weights, self(aten.squeeze.dim, lse, 0)

    def _weighted(self, outs, weights, out_dtype, acc, reduce: bool):
        w = self(aten.unsqueeze.default, weights, -1)
        contrib = self.where(self(aten.gt.Scalar, w, 0), self(aten.mul.Tensor, w, self.cast(outs, acc)), 0.0)
        if reduce:
            contrib = self(aten.sum.dim_IntList, contrib, [0])
        return self.cast(contrib, out_dtype) if out_dtype != acc else contrib

    def _merge_aten(self, outs, lses, outs_val, lse_dtype):
        weights, lse = self._weights(lses, lse_dtype)
        acc = torch.promote_types(lse_dtype, outs_val.dtype)
        return self._weighted(outs, weights, outs_val.dtype, acc, reduce=True), lse

    def rescale_to_global(self, node: torch.fx.Node) -> None:
        out, lse, lses_all = node.args
        out_val, lse_out_val = node.meta["val"]
        acc_lse = _val(lse_out_val).dtype
        with self.graph.inserting_before(node):
            _, lse_global = self._weights(lses_all, acc_lse)
            own = self.sanitize(lse, acc_lse)
            weight = self.where(self(aten.eq.Scalar, lse_global, NEG_INF), 0.0,
                                self(aten.exp.default, self(aten.sub.Tensor, own, lse_global)))
            acc = _val(out_val).dtype
            scaled = self._weighted(out, weight, acc, acc, reduce=False)
        self.replace(node, (scaled, lse_global))
        self.count("rescale_to_global->aten")


def _mutates(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)
