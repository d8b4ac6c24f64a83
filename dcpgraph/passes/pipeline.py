"""The compiler pipeline: a traced, canonical Program → the per-rank program the engine runs.

The front end (:func:`dcpgraph.trace`) has already run ``trace`` and ``canonicalize_attention``.
Then, in this order (:data:`PIPELINE`; each pass's ``requires=`` says why it sits where it does):

1. ``absorb_mla``       MLA attention → attention over the latent (no-op for GQA);
2. ``insert_kv_cache``  canonical attention → paged KV cache read + new-token attention + merge;
3. ``select_logits``    the LM head computes only the rows that will be sampled;
4. ``shard_tp``         tensor parallelism from the TP plan (collectives, sharded state);
5. ``fuse_new_tokens``  one paged read covers context and new tokens (global counts; off for the
                        Ascend backends, whose attention takes no causal bound in the cache);
6. ``shard_dcp``        paged reads sharded over DCP groups: local counts, LSE merge across ranks;
7. ``fuse_mla_preprocess`` MLA only, ``mlapo=True``: each layer's preprocess → ``mla_preprocess``;
8. ``fuse_linears``     linears reading one input (q/k/v, gate/up) → one linear over their rank's
                        weights concatenated, then slices (with ``fuse_linears=True``; off by default);
9. ``native_linear``    linears by bf16/fp32 CPU weights → ``linear_bf16``/``linear_f32`` (native for decode rows);
10. ``native_rms_norm`` HF's RMSNorm chains on bf16 CPU activations → ``rms_norm_bf16``;
11. ``native_rotary``   HF's rotary chains on CPU queries/keys (bf16, fp16, fp32) → ``rotary_embedding``.

The configuration adds passes where it asks for them (:func:`default_passes`):

- ``split_pcp_prefill`` (``pcp > 1``) right before ``insert_kv_cache``: each PCP rank computes its
  zigzag share of the step's tokens, the attention operands and the LM head's input all-gathered
  over the PCP group (``shard_dcp`` then lowers with ``comm="a2a"``);
- ``expert_parallel`` (``enable_expert_parallel``) first: the plan's routed experts become
  expert-parallel before ``shard_tp`` reads the plan;
- ``experts_over_replicas`` (``enable_expert_parallel`` with ``data_parallel_size > 1``) right
  before ``shard_tp``: the routed experts are partitioned over every rank of the replicas and
  dispatched/combined across them; ``shard_tp`` then leaves them alone;
- ``return_hidden_states`` (MTP speculation) right after ``select_logits``: the program also
  returns the final hidden states of every token (output 1);
- ``layer_group_tables`` (``hybrid_kv_cache``) last: sliding-window layers get their own block
  table and slot mapping, sized by the windows of the traced program's attention;
- for DeepSeek-V4's compressed layers, ``insert_compressed_cache`` right after ``insert_kv_cache``
  (canonical compressed ops → paged caches and open-window state slots);
- for a hybrid's recurrent layers, ``insert_recurrent_state`` right after ``insert_kv_cache``
  (canonical recurrent ops → state pools) and ``shard_recurrent_tp`` right after ``shard_tp``
  (their heads/channels and pools split over TP by kind).

:func:`compile_program` is the one way a traced Program becomes a per-rank program: the target,
a draft model and an MTP layer all go through it.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError, UnsupportedModelError
from ..mesh import Mesh
from ..pcp.step_rows import grouped_queries
from ..program import Program
from .absorb_mla import absorb_mla
from .expert_parallel import expert_parallel
from .experts_over_replicas import experts_over_replicas
from .fuse_linears import fuse_linears
from .fuse_mla_preprocess import fuse_mla_preprocess
from .fuse_new_tokens import fuse_new_tokens
from .insert_compressed_cache import insert_compressed_cache
from .insert_kv_cache import insert_kv_cache
from .insert_recurrent_state import insert_recurrent_state
from .layer_group_tables import layer_group_tables, model_windows
from .manager import ProgramPass, run_passes
from .native_linear import native_linear
from .native_rms_norm import native_rms_norm
from .native_rotary import native_rotary
from .return_hidden_states import return_hidden_states
from .select_logits import select_logits
from .shard_dcp import shard_dcp
from .shard_recurrent_tp import TP_RULES, shard_recurrent_tp
from .shard_tp import shard_tp
from .split_pcp_prefill import split_pcp_attention, split_pcp_prefill

PIPELINE: tuple[ProgramPass, ...] = (
    absorb_mla,
    insert_kv_cache,
    select_logits,
    shard_tp,
    fuse_new_tokens,
    shard_dcp,
    fuse_mla_preprocess,
    fuse_linears,
    native_linear,
    native_rms_norm,
    native_rotary,
)


def default_passes(mesh: Mesh, *, block_size: int, comm: str, plan=None, kv_cache_dtype: str = "auto",
                   mlapo: bool = True, return_hidden: bool = False, comm_workload=None,
                   fuse_new: bool = True, expert_parallel_experts: bool = False,
                   windows: tuple[int, ...] | None = None, recurrent: bool = False,
                   expert_replicas: tuple[int, int] | None = None,
                   compressed: bool = False, sparse: bool = False,
                   fuse_siblings: bool = False) -> list[ProgramPass]:
    """:data:`PIPELINE` with the configuration's options bound to the passes that take them
    (``comm_workload``: what ``comm="auto"`` prices for, see :mod:`.shard_dcp_auto`), and the
    passes the configuration adds: ``expert_parallel`` with ``expert_parallel_experts``,
    ``return_hidden_states`` with ``return_hidden``, ``layer_group_tables`` when ``windows`` (the
    model's sliding windows) is given, and with ``recurrent`` (a hybrid's recurrent layers)
    ``insert_recurrent_state`` after ``insert_kv_cache`` and ``shard_recurrent_tp`` after
    ``shard_tp``; with ``expert_replicas = (D, d)`` (replica ``d`` of ``D``, which needs
    ``expert_parallel_experts``) ``experts_over_replicas`` right before ``shard_tp``; with
    ``compressed`` (DeepSeek-V4's CSA/HCA layers) ``insert_compressed_cache`` right after
    ``insert_kv_cache``. With ``pcp > 1`` ``split_pcp_prefill`` runs before ``insert_kv_cache``,
    with ``split_pcp_attention`` after ``fuse_new_tokens`` where a rank attends its own or its DCP
    group's rows (:func:`pcp_query_rows`).
    ``fuse_siblings`` is ``fuse_linears``'s ``enabled``."""
    options = {
        insert_kv_cache.name: {"block_size": block_size, "kv_cache_dtype": kv_cache_dtype},
        shard_tp.name: {"mesh": mesh, "plan": plan},
        shard_dcp.name: {"comm": comm, "workload": comm_workload},
        fuse_new_tokens.name: {"enabled": fuse_new},
        fuse_mla_preprocess.name: {"enabled": mlapo},
        fuse_linears.name: {"enabled": fuse_siblings},
    }
    passes = [p.with_options(**options[p.name]) if p.name in options else p for p in PIPELINE]
    if mesh.pcp > 1:
        queries = pcp_query_rows(mesh, fuse_new=fuse_new, sparse=sparse)
        passes.insert(next(i for i, p in enumerate(passes) if p.name == insert_kv_cache.name),
                      split_pcp_prefill.with_options(mesh=mesh, queries=queries))
        if queries != "step":
            passes.insert(next(i for i, p in enumerate(passes) if p.name == fuse_new_tokens.name) + 1,
                          split_pcp_attention.with_options(queries=queries))
    if return_hidden:
        passes.insert(passes.index(select_logits) + 1, return_hidden_states)
    if expert_parallel_experts:
        passes.insert(0, expert_parallel)
    if expert_replicas is not None:
        replicas, replica = expert_replicas
        at = next(i for i, p in enumerate(passes) if p.name == shard_tp.name)
        passes.insert(at, experts_over_replicas.with_options(mesh=mesh, replicas=replicas, replica=replica))
    if windows is not None:
        passes.append(layer_group_tables.with_options(windows=windows))
    if recurrent:
        at = next(i for i, p in enumerate(passes) if p.name == insert_kv_cache.name)
        passes.insert(at + 1, insert_recurrent_state)
        at = next(i for i, p in enumerate(passes) if p.name == shard_tp.name)
        passes.insert(at + 1, shard_recurrent_tp)
    if compressed:
        at = next(i for i, p in enumerate(passes) if p.name == insert_kv_cache.name)
        passes.insert(at + 1, insert_compressed_cache.with_options(dcp=mesh.dcp))
    return passes


def refuse_recurrent_layers_on(program: Program, mesh: Mesh) -> None:
    """Refuse by name a hybrid on a mesh other than tp=1·dcp=1 where a recurrent layer's kind has
    no TP rule (:data:`~dcpgraph.passes.shard_recurrent_tp.TP_RULES`), before any pass runs."""
    recurrent = program.facts.extra.get("recurrent_layers") or {}
    without_rule = {i: kind for i, kind in recurrent.items() if kind not in TP_RULES}
    if without_rule and (mesh.tp, mesh.dcp) != (1, 1):
        raise UnsupportedModelError(
            f"{program.facts.architecture}: recurrent layers ({describe_recurrent(without_rule)}) compile at "
            f"tp=1, dcp=1 only, got tp={mesh.tp}, dcp={mesh.dcp} (kinds split over TP: {sorted(TP_RULES)})"
        )


def pcp_query_rows(mesh: Mesh, *, fuse_new: bool, sparse: bool) -> str:
    """Which rows a PCP rank's attention queries are (:func:`split_pcp_prefill`'s ``queries``):
    its own (``"rank"``) at ``dcp = 1``; its DCP group's (``"group"``) where the group is
    ``1 < dcp < pcp`` PCP ranks of one TP rank; otherwise every step row (``"step"``: the group
    spans all PCP ranks, so its rows are the step's). ``"rank"`` and ``"group"`` need the fused
    paged read (per-query bounds) and no sparse layer (its indexer reads the whole step)."""
    if not fuse_new or sparse:
        return "step"
    if mesh.dcp == 1:
        return "rank"
    return "group" if grouped_queries(mesh) else "step"


def pcp_comm(mesh: Mesh, comm: str) -> str:
    """The DCP lowering at ``pcp > 1``: ``"auto"`` is ``"a2a"``; ``"ag"`` (each rank computes its DCP
    group's query heads from replicated projections, which takes the group for consecutive TP
    ranks) is refused by name."""
    if mesh.pcp == 1:
        return comm
    if comm == "ag":
        raise ConfigError(f"comm='ag' is not supported with prefill_context_parallel_size={mesh.pcp}; "
                          "use comm='auto', 'a2a' or 'ag_rs'")
    return "a2a" if comm == "auto" else comm


def describe_recurrent(recurrent: dict[int, str]) -> str:
    """``"mamba2 at layers [0, 2]"``, for errors."""
    layers = sorted(recurrent)
    return (f"{', '.join(sorted(set(recurrent.values())))} at layers {layers[:8]}"
            f"{'…' if len(layers) > 8 else ''}")


def compile_program(
    program: Program, mesh: Mesh, *, block_size: int = 16, interleave: int = 1,
    comm: str = "auto", plan=None, verify: bool = True, kv_cache_dtype: str = "auto", mlapo: bool = True,
    return_hidden: bool = False, comm_workload=None, fuse_new: bool = True, expert_parallel_experts: bool = False,
    hybrid_kv_cache: bool = False, expert_replicas: tuple[int, int] | None = None, fuse_linears: bool = False,
) -> Program:
    """Run the default pipeline on a traced ``program`` (from :func:`dcpgraph.trace`).
    ``fuse_new=False`` keeps the context/new split, for backends whose paged attention takes no
    causal bound (:data:`dcpgraph.backends.registry.SPLIT_NEW_TOKENS`; ``compile``'s
    ``fuse_new_tokens`` option). ``expert_parallel_experts`` and ``hybrid_kv_cache`` are
    ``compile``'s ``enable_expert_parallel`` and ``hybrid_kv_cache``; ``expert_replicas = (D, d)``
    compiles replica ``d`` of ``D`` data-parallel replicas whose routed experts are partitioned
    over all of their ranks (:mod:`.experts_over_replicas`). ``fuse_linears=True`` runs sibling
    linears as one (:mod:`.fuse_linears`; off by default)."""
    if not isinstance(program, Program):
        raise TypeError(
            f"compile_program takes a Program from dcpgraph.trace(model), not {type(program).__name__}"
        )
    refuse_recurrent_layers_on(program, mesh)
    comm = pcp_comm(mesh, comm)
    mlapo = mlapo and mesh.pcp == 1  # its pattern does not see through split_pcp_prefill's gathers
    program = program.replace(lowering=program.lowering.decided(interleave=interleave))
    passes = default_passes(mesh, block_size=block_size, comm=comm, plan=plan, kv_cache_dtype=kv_cache_dtype,
                            mlapo=mlapo, return_hidden=return_hidden, comm_workload=comm_workload,
                            fuse_new=fuse_new, expert_parallel_experts=expert_parallel_experts,
                            windows=model_windows(program) if hybrid_kv_cache else None,
                            recurrent=bool(program.facts.extra.get("recurrent_layers")),
                            expert_replicas=expert_replicas,
                            compressed=bool(program.facts.extra.get("compressed_layers")),
                            sparse=any(n.target is torch.ops.dcpgraph.sparse_attention.default
                                       for n in program.graph_module.graph.nodes),
                            fuse_siblings=fuse_linears)
    return run_passes(program, passes, verify=verify)
