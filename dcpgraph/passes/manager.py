"""Pure passes ``Program -> Program`` and the manager that orders, runs and checks them.

A pass is declared with :func:`program_pass`: its body gets the input Program (which it must not
mutate) and returns ``(new_program, summary)``. Calling the pass times the body and appends a
:class:`~dcpgraph.program.Provenance` record and a stage snapshot named after the pass.

A pass declares two lists of facts about Programs:

- ``requires``: :class:`Requirement` s of its *input* (a pass already run, a pass not yet run,
  both read from the input's provenance, or a predicate), so a misordered pipeline fails before
  the pass runs, naming both passes;
- ``ensures``: invariants of its *output*, raising :class:`~dcpgraph.errors.VerificationError`.

:func:`run_passes` does, for every pass in order:

1. check ``requires`` on the input (always) — :class:`~dcpgraph.errors.PassOrderError`;
2. run the pass;
3. with ``verify``: the input graph's text is unchanged (purity) and the structural verifier
   (:func:`~dcpgraph.passes.verify.check_structure`) passes;
4. always: shape propagation (:func:`~dcpgraph.passes.verify.propagate_shapes`) stores
   ``meta["val"]`` on every node, which later passes read; a failure raises;
5. with ``verify``: the pass's ``ensures``.

Every failure after the pass ran is a ``VerificationError`` whose message starts
``after pass '<name>':``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import PassOrderError, VerificationError
from ..program import Program, Provenance
from .verify import check_structure, propagate_shapes

Invariant = Callable[[Program], None]


@dataclass(frozen=True)
class Requirement:
    """A fact a pass needs of its input Program.

    ``needs`` completes the sentence "pass X requires ..."; ``holds(program)`` tests it.
    ``stage`` is the pass name the fact is about (None for a plain predicate), so a test can check
    that every requirement names a pass that exists.
    """

    needs: str
    holds: Callable[[Program], bool]
    stage: str | None = None


def ran(stage: str, why: str = "") -> Requirement:
    """The pass named ``stage`` is among those that made the input (``Program.passes_run``)."""
    because = f" ({why})" if why else ""
    return Requirement(f"{stage!r} to have run{because}", lambda p: stage in p.passes_run(), stage)


def not_yet_run(stage: str, why: str = "") -> Requirement:
    """The pass named ``stage`` is not among those that made the input: it must come later."""
    because = f" ({why})" if why else ""
    return Requirement(
        f"{stage!r} not to have run yet, it must run after this pass{because}",
        lambda p: stage not in p.passes_run(), stage,
    )


def holds(needs: str, predicate: Callable[[Program], bool]) -> Requirement:
    """A predicate of the input Program, described by ``needs``."""
    return Requirement(needs, predicate)


@dataclass(frozen=True)
class ProgramPass:
    """A named pass; calling it runs ``body`` with ``options`` bound and stamps a stage.

    The instance carries the body's ``__doc__``/``__name__``/``__module__``/``__qualname__`` and
    ``__wrapped__ = body`` (``functools.update_wrapper`` semantics), so ``help(pass)`` reads the
    body's documentation.
    """

    name: str
    body: Callable[..., tuple[Program, str]]
    ensures: tuple[Invariant, ...] = ()
    options: tuple[tuple[str, object], ...] = ()
    requires: tuple[Requirement, ...] = ()

    def __post_init__(self) -> None:
        for attr in functools.WRAPPER_ASSIGNMENTS:
            if hasattr(self.body, attr):
                object.__setattr__(self, attr, getattr(self.body, attr))
        object.__setattr__(self, "__wrapped__", self.body)

    def __call__(self, program: Program) -> Program:
        start = time.perf_counter()
        result, summary = self.body(program, **dict(self.options))
        record = Provenance(self.name, time.perf_counter() - start, summary)
        return result.with_stage(self.name, result.graph_module, record)

    def with_options(self, **options: object) -> ProgramPass:
        """This pass with keyword options bound (e.g. ``shard_dcp.with_options(comm="a2a")``)."""
        merged = {**dict(self.options), **options}
        return ProgramPass(self.name, self.body, self.ensures, tuple(sorted(merged.items())), self.requires)

    def check_requirements(self, program: Program) -> None:
        """Raise :class:`PassOrderError` naming the first requirement ``program`` does not meet."""
        for requirement in self.requires:
            if not requirement.holds(program):
                raise PassOrderError(
                    f"pass {self.name!r} requires {requirement.needs}; "
                    f"stages so far: {program.passes_run()}"
                )


def program_pass(
    name: str, *, requires: Sequence[Requirement | str] = (), ensures: Sequence[Invariant] = (),
) -> Callable[..., ProgramPass]:
    """Declare a pass. The body returns ``(new_program, summary_of_what_it_matched)``.

    A plain string in ``requires`` is shorthand for :func:`ran` of that pass name.
    """
    needs = tuple(ran(r) if isinstance(r, str) else r for r in requires)

    def wrap(body: Callable[..., tuple[Program, str]]) -> ProgramPass:
        return ProgramPass(name, body, tuple(ensures), requires=needs)

    return wrap


def run_passes(program: Program, passes: Sequence[ProgramPass], *, verify: bool = True) -> Program:
    """Run ``passes`` in order with the checks listed in the module docstring."""
    for p in passes:
        p.check_requirements(program)
        before = str(program.graph_module.graph) if verify else None
        result = p(program)
        if verify and str(program.graph_module.graph) != before:
            raise VerificationError(f"pass {p.name!r} mutated its input program (passes must be pure)")
        try:
            if verify:
                check_structure(result)
            propagate_shapes(result)
            if verify:
                for invariant in p.ensures:
                    invariant(result)
        except VerificationError as err:
            raise VerificationError(f"after pass {p.name!r}: {err}") from err
        except Exception as err:  # a crash inside an invariant is a broken program too
            raise VerificationError(
                f"after pass {p.name!r}: invariant check crashed: {type(err).__name__}: {err}"
            ) from err
        program = result
    return program
