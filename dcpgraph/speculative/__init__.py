"""Speculative decoding: proposers draft tokens, the target verifies them in one multi-token step.

The runtime holds what the engine needs of any method: ``speculative_config`` (vLLM's shape,
:mod:`dcpgraph.runtime.speculative_config`), the proposer interface and its registry
(:mod:`dcpgraph.runtime.proposer`), rejection sampling (:mod:`dcpgraph.runtime.rejection`) and
acceptance statistics (:mod:`dcpgraph.runtime.acceptance`). This package holds the methods:

- :mod:`.ngram` (prompt lookup), :mod:`.draft_model` (a smaller LM compiled on the same mesh),
  :mod:`.mtp` (checks), :mod:`.mtp_module` (the DeepSeek-V3 MTP layer, traced like the main
  model), :mod:`.mtp_v4_module` (DeepSeek-V4's, after DeepSeek's ``MTPBlock``) and :mod:`.mtp_proposer` (MTP drafting from the target's final hidden states);
- :mod:`.build`: each method's factory, registered with the runtime when this package is imported.

Verification under DCP needs no CP-aware mask: the drafts are the *new* tokens of the
context/new split, causal among themselves without communication, so a multi-token query is
exact by construction.
"""

from . import build  # noqa: F401, E402  (registers the proposers Engine builds by method)
