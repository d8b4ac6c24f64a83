"""The proposers of :mod:`dcpgraph.speculative`, registered by method with the runtime
(:func:`dcpgraph.runtime.proposer.register_proposer`) when this package is imported."""

from __future__ import annotations

from ..errors import ConfigError
from ..runtime.graph_mode import DecodeBuckets
from ..runtime.model_runner import ModelRunner
from ..runtime.proposer import register_proposer
from ..runtime.speculative_config import SpeculativeConfig
from .draft_model import DraftModelProposer
from .mtp_proposer import MTPProposer
from .ngram import NgramProposer


def _ngram(config: SpeculativeConfig, draft, **_):
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


def _draft_model(config: SpeculativeConfig, draft, *, executor_cls, num_blocks: int, buckets,
                 max_batched_tokens: int | None = None):
    if draft is None:
        raise ConfigError("method 'draft_model' needs the compiled draft: build the engine with "
                          "dcpgraph.compile(..., speculative_config=...)")
    program, graphs = draft
    draft_buckets = DecodeBuckets(buckets.sizes, buckets.table_width) if buckets is not None else None
    runner = ModelRunner(program, executor_cls(program, num_blocks, graphs), draft_buckets)
    return DraftModelProposer(runner, max_batched_tokens)


def _mtp(config: SpeculativeConfig, draft, *, executor_cls, num_blocks: int, buckets,
         max_batched_tokens: int | None = None):
    if draft is None:
        raise ConfigError("method 'mtp' needs the compiled MTP layer: build the engine with "
                          "dcpgraph.compile(..., speculative_config=...) from a checkpoint")
    program, graphs = draft
    mtp_buckets = DecodeBuckets(buckets.sizes, buckets.table_width) if buckets is not None else None
    return MTPProposer(program, executor_cls(program, num_blocks, graphs), max_batched_tokens, mtp_buckets)


register_proposer("ngram", _ngram)
register_proposer("draft_model", _draft_model)
register_proposer("mtp", _mtp)
