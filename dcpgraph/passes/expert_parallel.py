"""``expert_parallel``: the TP plan's routed experts become expert-parallel (``enable_expert_parallel``).

The model's ``base_model_ep_plan`` entries (``grouped_gemm`` expert parameters, the
``ep_dispatch_experts`` module) replace its tensor-parallel expert entries in ``facts.tp_plan``,
so that ``shard_tp`` partitions whole experts over the TP ranks instead of slicing every expert
(the rewrite itself: :mod:`dcpgraph.passes.tp_modules`). The graph is unchanged. A model without
routed experts has no EP plan and is refused by name.
"""

from __future__ import annotations

from .manager import not_yet_run, program_pass
from .tp_styles import with_expert_parallel


@program_pass(
    "expert_parallel",
    requires=[not_yet_run("shard_tp", "shard_tp reads the plan this pass rewrites")],
)
def expert_parallel(program):
    result = with_expert_parallel(program)
    moved = sorted(k for k in result.facts.tp_plan if result.facts.tp_plan[k] != program.facts.tp_plan.get(k))
    return result, f"{len(moved)} plan entries expert-parallel: {', '.join(moved)}"
