"""``SamplingParams`` (vLLM's names and defaults), imported here from where the engine defines it:
:mod:`dcpgraph.runtime.sampling_params` has the class, its checks and its conversion to the
engine's keyword arguments (:meth:`~dcpgraph.runtime.sampling_params.SamplingParams.engine_params`).
"""

from __future__ import annotations

from ..runtime.sampling_params import _GREEDY_BELOW, MAX_LOGPROBS, SamplingParams

__all__ = ["MAX_LOGPROBS", "SamplingParams", "_GREEDY_BELOW"]
