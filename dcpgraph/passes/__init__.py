"""Compiler passes, each a pure ``Program -> Program`` declared with
:func:`~dcpgraph.passes.manager.program_pass`.

The pipeline, in order, is :data:`dcpgraph.passes.pipeline.PIPELINE`; :mod:`.manager` runs and
checks passes, :mod:`.verify` holds the generic invariants. Importing this package imports no pass.
"""
