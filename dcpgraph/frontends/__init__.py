"""Front ends: turn a model into a traced, canonical :class:`~dcpgraph.program.Program`.

:mod:`.hf` handles HF transformers causal LMs, :mod:`.fx` other ``nn.Module`` s; both go through
:mod:`.export`. :func:`dcpgraph.trace` picks one. Importing this package imports no front end.
"""
