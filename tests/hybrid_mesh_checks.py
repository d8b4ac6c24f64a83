"""What the hybrid mesh tests share (``test_hybrid_mesh``, ``test_mamba2_mesh``, ``test_kda_mesh``,
``test_lightning_mesh``, ``test_olmo_hybrid_mesh``): running a traced program's graph on a whole
prompt, counting its ops, serving :data:`hybrid_models.PROMPTS` at a mesh against HF ``generate``,
and reading what ``shard_recurrent_tp`` decided."""

from __future__ import annotations

import torch
from hybrid_models import NEW_TOKENS, PROMPTS

BLOCK = 4
PREFILL_CHUNK = 8  # tokens a step: every prompt but the shortest takes more than one
# Blocks per rank that hold the longest request alone (17 tokens over dcp ranks in blocks of 4)
# but, at dcp <= 2, not the three at once (so one is preempted). At dcp=4 the smallest such cache
# (2 blocks, 32 tokens) already runs the three without a preemption.
PREEMPTING_BLOCKS = {1: 7, 2: 4, 4: 2}


def forward(program, ids: torch.Tensor) -> torch.Tensor:
    """The traced (uncompiled) program's graph on ``ids`` at positions 0..n-1: its logits."""
    args = []
    for spec in program.inputs:
        if spec.kind == "user":
            args.append(ids if spec.target == "input_ids" else torch.arange(ids.shape[1]).unsqueeze(0))
        else:
            args.append(program.state[spec.target])
    with torch.no_grad():
        out = program.graph_module(*args)
    return out[0] if isinstance(out, (tuple, list)) else out


def count(program, op) -> int:
    """Calls of ``op`` in the program's graph."""
    return sum(1 for n in program.graph_module.graph.nodes if n.op == "call_function" and n.target == op)


def run_on_mesh(model, program, tp: int, dcp: int, interleave: int = 1, blocks: dict[int, int] = PREEMPTING_BLOCKS):
    """Compile ``program`` at ``tp``·``dcp`` (blocks of :data:`BLOCK`, :data:`PREFILL_CHUNK`-token
    steps, ``blocks[dcp]`` blocks per rank, or the default sizing where ``dcp`` is not in ``blocks``),
    serve :data:`PROMPTS` greedily and check: the tokens equal HF ``generate``'s; with ``blocks[dcp]``
    blocks at dcp <= 2, at least one request was preempted; every state slot came back. The engine,
    for further checks."""
    import dcpgraph
    from dcpgraph.testing.generation import drain, hf_greedy

    want = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    sized = {"num_blocks": blocks[dcp]} if dcp in blocks else {}
    engine = dcpgraph.compile(program, tp=tp, dcp=dcp, interleave=interleave, block_size=BLOCK,
                              max_num_batched_tokens=PREFILL_CHUNK, **sized)
    for prompt in PROMPTS:
        engine.add_request(prompt, max_new_tokens=NEW_TOKENS)
    got = drain(engine)
    assert [got[i] for i in range(len(PROMPTS))] == want
    if sized and dcp <= 2:
        assert engine.scheduler.stats["preemptions"] >= 1
    assert sorted(engine.scheduler.state_slots.free) == list(range(engine.program.lowering.state_slots))
    return engine


def shard_rules(compiled) -> dict:
    """Parameter target → its shard rule, as ``shard_tp``/``shard_recurrent_tp`` left them (read
    before ``fuse_linears``, which may concatenate weights)."""
    return {s.target: s.shard for s in compiled.stage("fuse_mla_preprocess").inputs}


def recurrent_tp_summary(compiled) -> str:
    """What ``shard_recurrent_tp`` said it did (which layers it split, which it replicated)."""
    return next(p for p in compiled.provenance if p.name == "shard_recurrent_tp").summary


def users_within(node, depth: int) -> set:
    """Every node that uses ``node`` within ``depth`` steps."""
    frontier, found = {node}, set()
    for _ in range(depth):
        frontier = {u for n in frontier for u in n.users}
        found |= frontier
    return found


def reaches(node, targets, depth: int = 4) -> bool:
    """Whether one of ``targets`` uses ``node`` within ``depth`` steps (through a collective's wrapper ops)."""
    return bool(users_within(node, depth) & set(targets))
