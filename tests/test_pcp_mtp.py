"""MTP speculation (``method="mtp"``) with pcp > 1 in ``dcpgraph.compile``, emulated.

The MTP layer's program is split over the PCP ranks like the target's (its ``hidden_states``
input read at each rank's rows, its output state gathered back into step order). References:
HF ``generate`` on the same weights (greedy tokens must be identical), and the eager loop of
:class:`~dcpgraph.speculative.mtp_module.MTPModule` fed HF's final hidden states
(tests/mtp_reference.py): every draft the compiled proposer makes must equal that loop's, which
checks the target's gathered hidden-states output, the split MTP program and its DCP-sharded KV
cache kept in step with the accepted tokens.
"""

from __future__ import annotations

import pytest
import torch
from mtp_reference import eager_drafts, record_drafts

import dcpgraph
from dcpgraph.checkpoints.loader import load_program
from dcpgraph.testing.checkpoints import make_mtp_predictable, save_tiny_checkpoint
from dcpgraph.testing.generation import hf_greedy

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13]]
NEW = 12


@pytest.fixture(scope="module")
def mtp_case(tmp_path_factory):
    """A one-layer DeepSeek-V3 checkpoint whose MTP drafts are sometimes accepted (as in tests/test_mtp.py),
    the HF target and eager MTP module read from it, and HF's greedy tokens."""
    import transformers as tf

    from dcpgraph.speculative.mtp_module import eager_mtp_module

    path = save_tiny_checkpoint(tmp_path_factory.mktemp("v3mtp"), "deepseek_v3", layers=1, dtype=torch.float64,
                                mtp_weights=True)
    make_mtp_predictable(path, 0.01, hidden_part=0.3, mtp_attention=0.3)
    target = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    return load_program(path, "float64"), target, eager_mtp_module(path, torch.float64), \
        [hf_greedy(target, p, NEW) for p in PROMPTS]


# (1,2,2): gathered queries, the MTP cache sharded by DCP over the PCP ranks; (1,2,1): local queries
# (split_pcp_attention on the MTP layer's reads too). Each case compiles the target and traces and
# compiles the MTP layer: ~5 s at load 2, ~10-12 s at load 7 on 2 cores, so the second mesh is slow-tier.
@pytest.mark.parametrize("tp, pcp, dcp", [(1, 2, 2), pytest.param(1, 2, 1, marks=pytest.mark.slow)])
def test_pcp_mtp_drafts_equal_an_eager_loop_and_greedy_tokens_equal_hf(mtp_case, tp, pcp, dcp):
    program, target, mtp, reference = mtp_case
    engine = dcpgraph.compile(program, tp=tp, pcp=pcp, dcp=dcp, block_size=4, max_num_batched_tokens=8,
                              backend="eager", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    proposer = engine.runner.proposer
    assert "split_pcp_prefill" in proposer.program.passes_run()  # the MTP layer's own steps are split too
    assert {"pcp_rows", "pcp_order"} <= {s.name for s in proposer.program.inputs}
    seen = record_drafts(engine)
    assert engine.generate(PROMPTS, NEW) == reference
    stats = engine.report()["speculative"]
    assert 0 < stats["accepted"] < stats["drafted"], stats  # drafts kept and drafts dropped
    assert any(n.startswith("decode[") for n in proposer.graph_steps)  # one-token MTP steps in PCP buckets
    assert len(seen) >= 15
    for tokens, s, drafts in seen:
        assert drafts == eager_drafts(target, mtp, tokens, s, len(drafts)), (tokens[: s + 1], drafts)
