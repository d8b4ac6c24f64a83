"""Shared pytest configuration for dcpgraph's tests.

Sections (append new fixtures below the last one, keeping each section self-contained):

1. Hypothesis profiles: ``ci`` (default: deterministic, no example database, no deadline) and
   ``dev`` (more examples, for local runs). Select with ``HYPOTHESIS_PROFILE=dev pytest ...``.
2. Fixtures.
3. The ``gpu`` tier: tests marked ``gpu`` skip, saying why, where torch sees no CUDA device.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from extended_tier import mark_extended
from hypothesis import settings

QWEN_PADDED_VOCAB = 333  # the session Qwen3 checkpoint's model vocabulary (its tokenizer has 321)

# -- 1. Hypothesis profiles ---------------------------------------------------------------------
settings.register_profile(
    "ci",
    derandomize=True,  # the same examples on every run and every machine
    deadline=None,  # CPU timings vary too much on shared runners
    database=None,  # nothing written to .hypothesis/ and no replay of old local failures
    max_examples=50,
    print_blob=True,  # a failure prints the @reproduce_failure blob
)
settings.register_profile(
    "dev",
    deadline=None,
    max_examples=500,
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# -- 2. Fixtures ---------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """2-core CI machines: intra-op threads fighting other processes cost far more than they give."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# -- 3. The gpu tier -----------------------------------------------------------------------------


SLOW_BY_DURATION = Path(__file__).with_name("slow_by_duration.txt")


def _slow_by_duration() -> frozenset[str]:
    """Node ids listed in ``slow_by_duration.txt`` (seconds, then the id; ``#`` lines are comments)."""
    lines = SLOW_BY_DURATION.read_text().splitlines()
    return frozenset(line.split(maxsplit=1)[1] for line in lines if line.strip() and not line.startswith("#"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Before ``-m`` selects: the default tier's slowest tests by measured duration join the slow
    tier (which CI also runs), so the README's default command stays near 20 minutes on 2 cores;
    then the matrix cases outside their representatives join the extended tier
    (:mod:`extended_tier`); then the gpu tier skips, with the reason, where torch sees no CUDA device."""
    listed = _slow_by_duration()
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)
    mark_extended(items, config.args)
    if torch.cuda.is_available():
        return
    reason = ("no CUDA device: torch.cuda.is_available() is False (this torch build: "
              f"{torch.__version__}); the gpu tier runs on a machine with a GPU and a CUDA build of torch")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """A GQA (Qwen3) and an MLA (DeepSeek-V2) tiny checkpoint directory, written once per session
    and only read by the tests that use them (a test that edits a checkpoint saves its own). Their
    vocabularies are what real checkpoints have, not what suits tp: DeepSeek-V2's 321 ids are
    divisible by no tp > 1, and Qwen3's model vocabulary (333, also odd) is larger than its
    tokenizer's 321, as Qwen's releases pad theirs."""
    from dcpgraph.testing.checkpoints import DEFAULT_VOCAB, save_tiny_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    return {"qwen3": save_tiny_checkpoint(root / "qwen3", "qwen3", vocab_size=QWEN_PADDED_VOCAB,
                                          tokenizer_vocab_size=DEFAULT_VOCAB),
            "deepseek_v2": save_tiny_checkpoint(root / "deepseek_v2", "deepseek_v2")}
