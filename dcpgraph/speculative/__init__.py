"""Speculative decoding: proposers draft tokens, the target verifies them in one multi-token step.

- :mod:`.config`: ``speculative_config`` (vLLM's shape), checked before any work;
- :mod:`.proposer`: the interface every method implements (:class:`~.proposer.Drafts`);
- :mod:`.ngram` (prompt lookup), :mod:`.draft_model` (a smaller LM compiled on the same mesh),
  :mod:`.mtp` (checks), :mod:`.mtp_module` (the DeepSeek-V3 MTP layer, traced like the main
  model) and :mod:`.mtp_proposer` (MTP drafting from the target's final hidden states);
- :mod:`.rejection`: greedy agreement and lossless rejection sampling;
- :mod:`.stats`: acceptance statistics for ``Engine.report()`` and ``/metrics``.

Verification under DCP needs no CP-aware mask: the drafts are the *new* tokens of the
context/new split, causal among themselves without communication, so a multi-token query is
exact by construction.
"""
