"""Pure passes ``Program -> Program`` and the manager that runs and verifies them.

A pass is declared with :func:`program_pass`: its body gets the input Program (which it must not
mutate) and returns ``(new_program, summary)``. The decorator times it, appends a
:class:`~dcpgraph.program.Provenance` record and a stage snapshot, and attaches the pass's own
invariants (``ensures``). :func:`run_passes` runs passes in the declared order and, after every
one, the generic verifier plus that pass's invariants; a failure raises
:class:`~dcpgraph.errors.VerificationError` naming the pass and the invariant. It also checks the
pass left its input untouched (purity), by comparing the input graph's text before and after.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import VerificationError
from ..program import Program, Provenance

Invariant = Callable[[Program], None]


@dataclass(frozen=True)
class ProgramPass:
    name: str
    body: Callable[..., tuple[Program, str]]
    ensures: tuple[Invariant, ...] = ()
    options: tuple[tuple[str, object], ...] = ()

    def __call__(self, program: Program) -> Program:
        start = time.perf_counter()
        result, summary = self.body(program, **dict(self.options))
        record = Provenance(self.name, time.perf_counter() - start, summary)
        return result.with_stage(self.name, result.graph_module, record)

    def with_options(self, **options: object) -> ProgramPass:
        """This pass with keyword options bound (e.g. ``shard_dcp.with_options(comm="a2a")``)."""
        merged = {**dict(self.options), **options}
        return ProgramPass(self.name, self.body, self.ensures, tuple(sorted(merged.items())))


def program_pass(name: str, *, ensures: Sequence[Invariant] = ()) -> Callable[..., ProgramPass]:
    """Declare a pass. The body returns ``(new_program, summary_of_what_it_matched)``."""

    def wrap(body: Callable[..., tuple[Program, str]]) -> ProgramPass:
        functools.update_wrapper(wrap, body)
        return ProgramPass(name, body, tuple(ensures))

    return wrap


def run_passes(program: Program, passes: Sequence[ProgramPass], *, verify: bool = True) -> Program:
    """Run ``passes`` in order; after each, verify and name the pass that broke an invariant."""
    from .verify import verify_program

    for p in passes:
        before = str(program.graph_module.graph) if verify else None
        try:
            result = p(program)
        except VerificationError:
            raise
        if verify:
            if str(program.graph_module.graph) != before:
                raise VerificationError(f"pass {p.name!r} mutated its input program (passes must be pure)")
            try:
                verify_program(result)
                for invariant in p.ensures:
                    invariant(result)
            except VerificationError as err:
                raise VerificationError(f"after pass {p.name!r}: {err}") from err
            except Exception as err:  # a crash inside verification is a broken program too
                raise VerificationError(
                    f"after pass {p.name!r}: invariant check crashed: {type(err).__name__}: {err}"
                ) from err
        else:
            # Later passes read node.meta["val"], which shape propagation (part of verification)
            # stores; without it shard_dcp crashed with KeyError 'val'. No check, so no error here:
            # a pass that needs a value that could not be propagated fails on its own.
            from .verify import propagate_shapes

            try:
                propagate_shapes(result)
            except Exception:
                pass
        program = result
    return program
