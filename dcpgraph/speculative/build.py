"""The proposer an engine uses for its ``speculative_config``."""

from __future__ import annotations

from ..errors import ConfigError
from .config import SpeculativeConfig
from .ngram import NgramProposer


def make_proposer(config: SpeculativeConfig, draft, *, executor_cls, num_blocks: int, buckets,
                  max_batched_tokens: int | None = None):
    """``draft``: ``(compiled draft Program, its CompiledGraphs)`` for ``method="draft_model"``,
    ``(compiled MTP Program, its CompiledGraphs)`` for ``method="mtp"``.
    The draft runs on its own executor (its own KV cache of ``num_blocks`` blocks, the target's
    block ids) with the target's decode bucket sizes; its catch-up forwards respect the target's
    ``max_batched_tokens``."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_model":
        if draft is None:
            raise ConfigError("method 'draft_model' needs the compiled draft: build the engine with "
                              "dcpgraph.compile(..., speculative_config=...)")
        from ..runtime.graph_mode import DecodeBuckets
        from ..runtime.model_runner import ModelRunner
        from .draft_model import DraftModelProposer

        program, graphs = draft
        draft_buckets = DecodeBuckets(buckets.sizes, buckets.table_width) if buckets is not None else None
        runner = ModelRunner(program, executor_cls(program, num_blocks, graphs), draft_buckets)
        return DraftModelProposer(runner, max_batched_tokens)
    if config.method == "mtp":
        if draft is None:
            raise ConfigError("method 'mtp' needs the compiled MTP layer: build the engine with "
                              "dcpgraph.compile(..., speculative_config=...) from a checkpoint")
        from ..runtime.graph_mode import DecodeBuckets
        from .mtp_proposer import MTPProposer

        program, graphs = draft
        mtp_buckets = DecodeBuckets(buckets.sizes, buckets.table_width) if buckets is not None else None
        return MTPProposer(program, executor_cls(program, num_blocks, graphs), max_batched_tokens, mtp_buckets)
    raise ConfigError(f"method {config.method!r} is not available: see dcpgraph.speculative")
