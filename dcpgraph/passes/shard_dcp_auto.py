"""``shard_dcp(comm="auto")``: the lowering :func:`dcpgraph.plan.comm_choice.choose_comm` prices
cheapest for this program, its mesh and the engine it is compiled for.

Everything priced is read from the TP-sharded program ``shard_dcp`` receives: the context reads'
query heads per rank and head dims (the bytes the lowerings move), the per-rank weight bytes of its
sharded state, the bytes ``ag``'s replicated projections add (the rules
:func:`~.shard_dcp_replicated.ag_rules` would give them), the KV cache's bytes per block, and
whether ``ag`` can lower it at all. The engine's side (link, ``max_model_len``, ``max_num_seqs``,
cache size) is a :class:`~dcpgraph.plan.comm_choice.CommWorkload`: ``dcpgraph.compile`` builds
it from its options, executor and device (:func:`compile_workload`); a pipeline run without one
prices a default engine: the link of the parameters' device, ``max_model_len`` as ``compile``
defaults it, 8 sequences.
"""

from __future__ import annotations

import os

import torch

from ..capacity import max_sequences
from ..kv_budget import blocks_for_budget, kv_bytes_per_block
from ..plan.comm_choice import CommWorkload, choose_comm, link_hardware, measured_link
from ..plan.model_shape import ModelShape
from ..program import STATE_KINDS, Program, weight_bytes_per_rank
from .graph_edit import context_reads
from .shard_dcp_replicated import ag_rules

COMPILE_DEFAULT_MAX_MODEL_LEN = 4096  # dcpgraph.compile's cap on the model's max_position_embeddings
TORCHAIR_BACKENDS = ("torchair", "npugraph_ex")


def collective_backend(distributed: bool, device: torch.device, backend) -> str:
    """The collective backend the engine's ranks will use: the running process group's under the
    distributed executor; otherwise the one ranks on ``device`` would use (HCCL for a torchair
    backend, NCCL for CUDA, gloo for the host), which the emulated executor stands in for."""
    import torch.distributed as dist

    if distributed and dist.is_available() and dist.is_initialized():
        name = str(dist.get_backend()).lower()
        return next((b for b in ("hccl", "nccl") if b in name), "gloo")
    if isinstance(backend, str) and backend in TORCHAIR_BACKENDS:
        return "hccl"
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _weights_device(program: Program) -> torch.device:
    """Where the ranks will run: a CUDA device if any state tensor is on one, else the host (a
    checkpoint traced on the meta device, :mod:`dcpgraph.checkpoints.loader`, counts as the host)."""
    devices = {t.device for t in program.state.values() if isinstance(t, torch.Tensor)}
    return next((d for d in devices if d.type == "cuda"), torch.device("cpu"))


def _device_name(link: str, device: torch.device) -> str:
    if link == "nccl" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device if torch.device(device).type == "cuda" else None)
    return ""


def compile_workload(program: Program, *, tp: int, distributed: bool, backend, max_model_len: int,
                     max_num_seqs: int, cache_size: dict):
    """The :class:`~dcpgraph.plan.comm_choice.CommWorkload` of an engine ``dcpgraph.compile``
    builds: ranks of one host share it (``LOCAL_WORLD_SIZE`` of them under torchrun, else ``tp``).
    Ranks of a running gloo world price with their links as measured now, agreed by all of them
    (:func:`~dcpgraph.plan.comm_choice.measured_link`; ``DCPGRAPH_MEASURE_LINKS=0`` keeps the
    preset figures); NCCL and HCCL links take their presets, and the emulated executor prices the
    gloo preset it stands in for."""
    import torch.distributed as dist


    device = _weights_device(program)
    link = collective_backend(distributed, device, backend)
    hw = link_hardware(link, ranks_per_host=int(os.environ.get("LOCAL_WORLD_SIZE", tp)),
                       device_name=_device_name(link, device))
    if (link == "gloo" and distributed and dist.is_available() and dist.is_initialized()
            and os.environ.get("DCPGRAPH_MEASURE_LINKS", "1") != "0"):
        hw = measured_link(hw)
    sizes = tuple((k, int(v)) for k, v in sorted(cache_size.items()) if v is not None)
    return CommWorkload(hw, max_model_len=max_model_len, max_num_seqs=max_num_seqs, cache_size=sizes)


def _default_workload(program: Program):
    max_len = program.facts.extra.get("max_position_embeddings") or COMPILE_DEFAULT_MAX_MODEL_LEN
    return compile_workload(program, tp=program.mesh.tp, distributed=False, backend="eager",
                            max_model_len=min(int(max_len), COMPILE_DEFAULT_MAX_MODEL_LEN), max_num_seqs=8,
                            cache_size={})


def _state_bytes(program: Program, name: str, rule) -> int:
    spec = next(s for s in program.inputs if s.name == name)
    full = program.state[spec.target]
    return int(torch.Size(rule.local_shape(tuple(full.shape), program.mesh.tp)).numel()) * full.element_size()


def auto_comm(program: Program, workload=None):
    """The :class:`~dcpgraph.plan.comm_choice.CommChoice` for ``program`` (TP-sharded, dcp > 1)."""
    workload = workload or _default_workload(program)
    mesh, facts = program.mesh, program.facts
    graph = program.graph_module.graph
    reads = context_reads(graph)
    q, out = reads[0].args[0].meta["val"], reads[0].meta["val"][0]
    shape = ModelShape(facts.architecture, facts.attention, facts.num_layers, facts.hidden_size,
                       num_q_heads=int(q.shape[1]) * mesh.tp, num_kv_heads=facts.num_kv_heads,
                       head_dim=int(q.shape[-1]), v_head_dim=int(out.shape[-1]), vocab_size=facts.vocab_size,
                       dtype_bytes=facts.dtype.itemsize)
    specs = {s.name: s for s in program.inputs}
    if facts.attention != "gqa":
        rules, refusal = {}, f"comm='ag' lowers GQA attention only, this is {facts.attention}"
    else:
        rules, refusal = ag_rules(graph, specs, mesh.dcp, mesh.tp)
    base = max(weight_bytes_per_rank(program))
    ag_extra = sum(_state_bytes(program, name, rule) - _state_bytes(program, name, specs[name].shard)
                   for name, rule in rules.items() if specs[name].kind in STATE_KINDS)
    block_size = int(program.lowering.block_size)
    num_blocks = blocks_for_budget(program, **dict(workload.cache_size), max_model_len=workload.max_model_len,
                                   max_num_seqs=workload.max_num_seqs)
    per_block = kv_bytes_per_block(program)
    context = workload.context
    batch = max(1, min(workload.max_num_seqs, max_sequences(num_blocks, context, block_size, mesh.dcp)))
    return choose_comm(shape, workload.hardware, tp=mesh.tp, dcp=mesh.dcp, context=context, batch=batch,
                       kv_bytes_per_token_layer=per_block / block_size / facts.num_layers,
                       kv_bytes_per_rank=num_blocks * per_block,
                       weight_bytes={"a2a": base, "ag_rs": base, "ag": base + ag_extra},
                       refused={"ag": refusal})
