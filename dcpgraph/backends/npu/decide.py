"""Whether a graph can go to GE at all: the dcpgraph ops it holds that have no lowering rule.

This is decided from the rules table alone (no torchair, no Ascend op looked up, no shapes), so
it gives the same answer on every machine and before anything compiles. A rule that exists but
refuses a call site (a dtype, a kernel limit) or needs an Ascend op that is not registered is
*not* this decision: those fail in :func:`~.lower.lower_npu` and fall back per graph with the
error (:class:`~dcpgraph.backends.fallback.FallbackGraph`), as before.
"""

from __future__ import annotations

import torch.fx

from .lower import _is_dcpgraph_op
from .rules import TABLE
from .rules_compressed import NO_GE_FORM


def unlowered_ops(gm: torch.fx.GraphModule) -> list[str]:
    """Names (``dcpgraph.<op>.<overload>``, sorted, each once) of the dcpgraph ops in ``gm`` that no
    rule of :data:`~.rules.TABLE` lowers."""
    names = {str(n.target) for n in gm.graph.nodes
             if n.op == "call_function" and _is_dcpgraph_op(n.target) and not TABLE.rules_for(n.target)}
    return sorted(names)


def ge_decision(gm: torch.fx.GraphModule) -> str | None:
    """``None`` when every dcpgraph op of ``gm`` has a GE lowering rule; otherwise the one-line
    reason the graph runs eagerly instead, naming the ops with no rule. For DeepSeek-V4's
    compressed ops (:data:`~.rules_compressed.NO_GE_FORM`) it says why they have none."""
    missing = unlowered_ops(gm)
    if not missing:
        return None
    reason = f"no GE lowering for {', '.join(missing)}"
    if all(_op_name(op) in NO_GE_FORM for op in missing):
        reason += (": per-request loops over lengths read on the host, which neither a GE graph nor an "
                   "aclgraph capture expresses")
    return reason


def _op_name(qualified: str) -> str:
    """``dcpgraph.compress_windows_.default`` → ``compress_windows_``."""
    parts = qualified.split(".")
    return parts[1] if len(parts) >= 3 else qualified
