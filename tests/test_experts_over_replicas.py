"""DP attention + EP: routed experts partitioned over every rank of ``D`` data-parallel replicas.

Default tier: a small experts module in HF's ``batched_mm`` form (weights gathered per routed
(token, expert) pair), exported, rewritten by :class:`ReplicaDispatch` and run in the emulator on
``D·tp`` ranks whose replicas hold different token counts, against a hand loop over tokens and
their chosen experts with the full weights; the refusals (experts the ranks do not divide, a
short ``ep_rows``). Slow tier: a tiny Qwen3-MoE compiled per replica and run in the emulator on
tp=1·dp=2 and tp=2·dcp=2·dp=2, every replica's logits against HF's forward on its own prompt.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dcpgraph import ConfigError
from dcpgraph.mesh import Mesh, ReplicaMesh
from dcpgraph.passes.experts_over_replicas import (
    ReplicaDispatch,
    check_experts_divide,
    valid_replica_counts,
)
from dcpgraph.passes.graph_edit import Emitter, add_placeholders
from dcpgraph.passes.tp_modules import mask_foreign_experts, module_paths
from dcpgraph.program import ReplicaExpertShard
from dcpgraph.runtime.emulator import run_spmd

EXPERTS, HIDDEN, INTER, TOP_K = 12, 8, 4, 2


class Experts(torch.nn.Module):
    """HF's ``batched_mm`` experts: each (token, expert) pair gathers its expert's weights."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.gate_up = torch.nn.Parameter(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, dtype=torch.float64))
        self.down = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, dtype=torch.float64))

    def forward(self, x, ids, weights):
        flat = ids.reshape(-1)
        rows = x.repeat_interleave(TOP_K, 0).unsqueeze(-1)
        gate, up = torch.bmm(self.gate_up[flat], rows).squeeze(-1).chunk(2, -1)
        out = torch.bmm(self.down[flat], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        return (out * weights.reshape(-1, 1)).view(x.shape[0], TOP_K, HIDDEN).sum(1)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = Experts()

    def forward(self, x, ids, weights):
        return self.experts(x, ids, weights) * 2.0


def hand_loop(block: Block, x, ids, weights) -> torch.Tensor:
    """Every token's chosen experts one at a time, full weights, no batching."""
    ex = block.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(TOP_K):
            e = int(ids[t, j])
            gate, up = (ex.gate_up[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (ex.down[e] @ (F.silu(gate) * up))
    return 2.0 * out


def rewritten(block: Block, tp: int, replicas: int) -> torch.fx.GraphModule:
    """The exported block with its experts dispatched over ``replicas·tp`` EP ranks."""
    exported = torch.export.export(block, example_inputs(5, torch.Generator().manual_seed(0)),
                                   dynamic_shapes=({0: torch.export.Dim("t", min=2)},) * 3, strict=False)
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(exported.graph_module.graph, {}))
    params = {n.name: n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("p_")}
    nodes = [n for n in graph.nodes if n.op == "call_function" and "experts" in module_paths(n)]
    ep = tp * replicas
    ep_rank, rows = add_placeholders(graph, ["ep_rank", "ep_rows"])
    ReplicaDispatch(graph, ep, ep_rank, rows).module("experts", nodes, lambda a: a.name in params)
    for name, full in (("p_experts_gate_up", block.experts.gate_up), ("p_experts_down", block.experts.down)):
        mask_foreign_experts(graph, Emitter(graph), params[name], name, full.detach(), ep, lambda: ep_rank,
                             set(nodes))
    return torch.fx.GraphModule(exported.graph_module, graph)


def example_inputs(tokens: int, gen: torch.Generator):
    x = torch.randn(tokens, HIDDEN, generator=gen, dtype=torch.float64)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=gen, dtype=torch.float64)
    return x, ids, weights


@pytest.mark.parametrize(("tp", "replicas", "counts"), [(1, 3, (5, 2, 3)), (2, 2, (1, 4)), (1, 2, (3, 3))])
def test_dispatch_and_combine_match_a_hand_loop(tp, replicas, counts):
    """Each replica's rows equal the hand loop on its own tokens, though the replicas hold
    different token counts and each rank holds only ``E/(D·tp)`` experts."""
    block = Block()
    gm = rewritten(block, tp, replicas)
    world = ReplicaMesh(Mesh(tp), replicas)
    gen = torch.Generator().manual_seed(7)
    inputs = [example_inputs(n, gen) for n in counts]
    rows = torch.zeros(max(counts), dtype=torch.int64)
    args = []
    for rank in world.ranks:
        replica, t = world.replica_of(rank)
        shard = ReplicaExpertShard(0, replicas * tp, replicas=replicas, replica=replica)
        local = [shard.local(p.detach(), t, tp) for p in (block.experts.gate_up, block.experts.down)]
        assert local[0].shape[0] == EXPERTS // (replicas * tp)
        args.append((*local, *inputs[replica], torch.tensor(replica * tp + t), rows))
    outs = run_spmd(gm, args, world)
    for rank in world.ranks:
        replica, _ = world.replica_of(rank)
        got = outs[rank][0] if isinstance(outs[rank], (tuple, list)) else outs[rank]
        assert got.shape == (counts[replica], HIDDEN)
        torch.testing.assert_close(got, hand_loop(block, *inputs[replica]), rtol=1e-12, atol=1e-12)


def test_the_rewrite_emits_the_same_code_every_time():
    """Ranks compare their programs' code across processes before serving; the rewrite must not
    depend on where its nodes happen to live in memory (set order), so repeated rewrites agree."""
    block = Block()
    codes = {rewritten(block, 2, 2).code for _ in range(6)}
    assert len(codes) == 1


def test_foreign_experts_contribute_nothing():
    """Two replicas whose tokens all pick replica 0's experts: replica 1's ranks compute only
    zeros for them, and the combine still gives both replicas the hand loop's rows."""
    block = Block()
    gm = rewritten(block, 1, 2)
    x = torch.randn(3, HIDDEN, dtype=torch.float64)
    ids = torch.tensor([[0, 1], [2, 1], [0, 2]])
    weights = torch.rand(3, TOP_K, dtype=torch.float64)
    world = ReplicaMesh(Mesh(1), 2)
    args = []
    for rank in world.ranks:
        shard = ReplicaExpertShard(0, 2, replicas=2, replica=rank)
        local = [shard.local(p.detach(), 0, 1) for p in (block.experts.gate_up, block.experts.down)]
        args.append((*local, x, ids, weights, torch.tensor(rank), torch.zeros(3, dtype=torch.int64)))
    outs = run_spmd(gm, args, world)
    for out in outs:
        got = out[0] if isinstance(out, (tuple, list)) else out
        torch.testing.assert_close(got, hand_loop(block, x, ids, weights), rtol=1e-12, atol=1e-12)


def test_short_ep_rows_is_refused():
    block = Block()
    gm = rewritten(block, 1, 2)
    world = ReplicaMesh(Mesh(1), 2)
    gen = torch.Generator().manual_seed(1)
    inputs = [example_inputs(n, gen) for n in (4, 2)]
    args = []
    for rank in world.ranks:
        shard = ReplicaExpertShard(0, 2, replicas=2, replica=rank)
        local = [shard.local(p.detach(), 0, 1) for p in (block.experts.gate_up, block.experts.down)]
        args.append((*local, *inputs[rank], torch.tensor(rank), torch.zeros(2, dtype=torch.int64)))
    with pytest.raises(RuntimeError, match="ep_rows is shorter"):
        run_spmd(gm, args, world)


def test_replica_mesh_groups():
    world = ReplicaMesh(Mesh(2, 2), 2)
    assert world.world_size == 4 and world.group("ep", 3) == (0, 1, 2, 3)
    assert world.group("tp", 2) == (2, 3) and world.group("dcp", 3) == (2, 3)
    assert world.replica_of(3) == (1, 1)
    with pytest.raises(ConfigError, match="replicas must be a positive int"):
        ReplicaMesh(Mesh(2), 0)


def test_experts_that_the_ranks_do_not_divide_are_refused_naming_valid_sizes():
    assert valid_replica_counts(8, 2) == [1, 2, 4]
    check_experts_divide(8, 2, 4)
    with pytest.raises(ConfigError, match=r"8 routed experts cannot be partitioned over 6 ranks; valid "
                                          r"data_parallel_size: \[1, 2, 4\]"):
        check_experts_divide(8, 2, 3)


# -- a real MoE decoder, compiled per replica --------------------------------------------------
BLOCK_SIZE = 4
PROMPTS = ((5, 9, 4, 77, 3, 8, 100), (11, 12, 13))


class TracedMoE(dict):
    """arch -> (HF model, dcpgraph trace), built on first use."""

    def get(self, arch):
        if arch not in self:
            import transformers as tf

            import dcpgraph
            from dcpgraph.models import tiny_config

            config = tiny_config(arch)
            config.initializer_range = 0.2
            torch.manual_seed(0)
            model = tf.AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
            self[arch] = (model, dcpgraph.trace(model))
        return self[arch]


@pytest.fixture(scope="module")
def traced_moe():
    return TracedMoE()


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "tp", "dcp"), [("qwen3_moe", 1, 1), ("qwen3_moe", 2, 2), ("deepseek_v3", 2, 1)])
def test_replicas_sharing_experts_give_hf_logits(traced_moe, arch, tp, dcp):
    """Two replicas prefill prompts of 7 and 3 tokens in one emulated step over ``2·tp`` ranks
    (each rank ``E/(2·tp)`` of the routed experts; DeepSeek-V3's MLA and shared experts stay
    inside the replica): every rank's logits equal HF's forward of its replica's prompt."""
    import dcpgraph
    from dcpgraph.passes.pipeline import compile_program
    from dcpgraph.program import STATE_KINDS
    from dcpgraph.runtime.executors import allocate_caches, rank_arguments
    from dcpgraph.runtime.step_inputs import Chunk, build_step_inputs
    from dcpgraph.testing.generation import hf_reference

    model, traced = traced_moe.get(arch)
    mesh, replicas = Mesh(tp, dcp), 2
    world = ReplicaMesh(mesh, replicas)
    programs = [compile_program(traced, mesh, block_size=BLOCK_SIZE, expert_parallel_experts=True,
                                expert_replicas=(replicas, d)) for d in range(replicas)]
    assert programs[1].lowering.expert_ranks == 2 * tp and programs[1].lowering.replica == 1
    moe_layers = sum(isinstance(s.shard, ReplicaExpertShard) for s in programs[0].inputs) // 2  # gate_up, down
    assert moe_layers >= 1
    text = dcpgraph.explain(programs[0])  # per MoE layer: three gathered inputs, one combine
    assert text.count(f"all_gather[ep, {2 * tp}]") == 3 * moe_layers
    assert text.count(f"reduce_scatter[ep, {2 * tp}, sum]") == moe_layers
    rows = torch.zeros(max(map(len, PROMPTS)), dtype=torch.int64)
    args = []
    for rank in world.ranks:
        replica, local = world.replica_of(rank)
        prompt, program = PROMPTS[replica], programs[replica]
        blocks = tuple(range(-(-len(prompt) // BLOCK_SIZE)))
        shared, own = build_step_inputs([Chunk(0, prompt, 0, blocks, logits_rows=len(prompt))], mesh, BLOCK_SIZE, 1)
        own = {**own[local], "ep_rank": torch.tensor(replica * tp + local)}
        state = program.local_state(local)
        held = dict(zip([s for s in program.inputs if s.kind in STATE_KINDS], state))
        experts = [(program.state[s.target].shape[0], t) for s, t in held.items() if isinstance(s.shard, ReplicaExpertShard)]
        assert len(experts) == 2 * moe_layers and all(t.shape[0] == full // (2 * tp) for full, t in experts)
        caches = allocate_caches(program, 8, torch.device("cpu"))
        args.append(rank_arguments(program, state, caches, {**shared, "ep_rows": rows}, own))
    outs = run_spmd([programs[world.replica_of(r)[0]].graph_module for r in world.ranks], args, world)
    with hf_reference(model) as reference, torch.no_grad():
        wanted = [reference(torch.tensor([p])).logits[0] for p in PROMPTS]
    for rank in world.ranks:
        got = outs[rank][0][0]
        torch.testing.assert_close(got, wanted[world.replica_of(rank)[0]], rtol=1e-10, atol=1e-10)


@pytest.mark.slow
def test_a_replica_program_is_refused_in_process(traced_moe):
    """Its MoE layers wait for the other replicas' ranks: only worker processes can run it."""
    import dcpgraph

    _, traced = traced_moe.get("qwen3_moe")
    with pytest.raises(ConfigError, match="runs on the distributed executor"):
        dcpgraph.compile(traced, block_size=BLOCK_SIZE, num_blocks=8, enable_expert_parallel=True,
                         expert_replicas=(2, 0))


def test_a_rank_reads_only_its_replica_slice_of_the_experts():
    """The checkpoint reader and the in-memory rule give rank ``t`` of replica ``d`` rows
    ``[(d·tp + t)·E/(D·tp), …)``, and nothing else is read."""
    from dcpgraph.checkpoints.tensor_sources import read_local

    full = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)

    class Source:
        shape = tuple(full.shape)
        reads: list = []

        def read(self, dim, start=None, stop=None):
            self.reads.append((dim, start, stop))
            return full if dim is None else full.narrow(dim, start, stop - start)

    rule = ReplicaExpertShard(0, 4, replicas=2, replica=1)
    source = Source()
    assert torch.equal(read_local(source, rule, 1, 2), full[6:8]) and source.reads == [(0, 6, 8)]
    assert torch.equal(rule.local(full, 0, 2), full[4:6]) and rule.local_shape((8, 3), 2) == (2, 3)
