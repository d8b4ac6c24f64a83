"""The lowering table: for each dcpgraph op, rules tried in order, each with its checker.

A rule (lightning-thunder's ``register_implementation(op, checker=, execution_transform=)`` is the
model) is a plain torch function with the op's signature plus keyword ``params``. Its ``checker``
looks at the call site — the op's arguments as fake values and the node itself — and returns
``None`` when the rule applies, or why it does not; the first rule that applies is traced into
the graph in place of the op (:mod:`.trace`). ``uses`` says what the rule emits: ``"npu"`` (an
Ascend op) or ``"aten"``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx


class NpuLoweringError(RuntimeError):
    """The graph cannot be lowered for GE (missing Ascend ops, or an unsupported dcpgraph form)."""


def value_of(node: Any) -> Any:
    """``node.meta['val']`` for an FX node (a tensor is required), the constant itself otherwise."""
    if not isinstance(node, torch.fx.Node):
        return node
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise NpuLoweringError(f"{node.name} has no tensor meta['val']: run shape propagation "
                               "(pass example_inputs) before lower_npu")
    return value


@dataclass(frozen=True)
class Site:
    """One call of a dcpgraph op: its node and its arguments as values (fake tensors, constants)."""

    node: torch.fx.Node
    args: tuple

    @classmethod
    def of(cls, node: torch.fx.Node) -> Site:
        return cls(node, tuple(value_of(a) for a in node.args))

    def output(self, index: int) -> torch.Tensor:
        """The fake value of the op's ``index``-th result."""
        return self.node.meta["val"][index]

    def used(self, index: int) -> bool:
        """Whether anything reads the op's ``index``-th result."""
        return any(u.target is operator.getitem and u.args[1] == index for u in self.node.users)


def always(site: Site) -> str | None:
    return None


def no_params(site: Site) -> dict:
    return {}


@dataclass(frozen=True)
class Rule:
    op: Any  # the dcpgraph OpOverload it replaces
    name: str  # what lower_npu counts, "<op>-><what it becomes>"
    lowering: Callable[..., Any]  # (*op args, **params(site)) -> the op's results
    checker: Callable[[Site], str | None] = always
    params: Callable[[Site], dict] = no_params
    uses: str = "aten"  # "npu" when it emits an Ascend op


@dataclass
class RuleTable:
    rules: dict[Any, list[Rule]] = field(default_factory=dict)

    def register(self, op, name: str, *, checker=always, params=no_params, uses: str = "aten"):
        """Decorator: add the decorated function as ``op``'s next rule (tried after earlier ones)."""
        if uses not in ("npu", "aten"):
            raise ValueError(f"uses must be 'npu' or 'aten', got {uses!r}")

        def add(lowering: Callable) -> Callable:
            self.rules.setdefault(op, []).append(Rule(op, name, lowering, checker, params, uses))
            return lowering

        return add

    def rules_for(self, op) -> tuple[Rule, ...]:
        return tuple(self.rules.get(op, ()))

    @staticmethod
    def choose(site: Site, candidates: tuple[Rule, ...]) -> Rule:
        """The first candidate whose checker accepts ``site``; else an error with every reason."""
        reasons = []
        for rule in candidates:
            why_not = rule.checker(site)
            if why_not is None:
                return rule
            reasons.append(f"{rule.name}: {why_not}")
        raise NpuLoweringError(f"{site.node.name}: no lowering of {site.node.target} applies ("
                               + ("; ".join(reasons) or "no candidate rule") + ")")


TABLE = RuleTable()
register = TABLE.register
