"""``LLM(..., prefill_context_parallel_size=2)`` on an MLA checkpoint (tiny DeepSeek-V2, the
``checkpoints`` fixture) on two gloo worker processes: greedy tokens equal HF ``generate`` on the
same weights with chunked prefill and a prefix-cache hit. float32: HF's grouped MoE matmul takes no
float64."""

from __future__ import annotations

import pytest

from dcpgraph import LLM, SamplingParams
from dcpgraph.checkpoints.model_dir import load_model
from dcpgraph.testing.generation import hf_greedy

NEW = 6
SHARED = [(7 * i + 3) % 300 for i in range(20)]  # five 4-token blocks, read back on the second round
ROUNDS = ([SHARED + [11, 12, 13], [5, 9, 4]], [SHARED + [40, 41]])


@pytest.mark.gloo
@pytest.mark.slow  # two worker processes each loading, compiling and generating: ~30-40 s on 2 loaded cores
def test_pcp_llm_runs_mla_on_workers_equal_to_hf_with_chunks_and_a_prefix_hit(checkpoints):
    path = checkpoints["deepseek_v2"]
    with LLM(model=path, dtype="float32", block_size=4, prefill_context_parallel_size=2,
             decode_context_parallel_size=2, max_num_batched_tokens=8, enable_prefix_caching=True,
             max_model_len=128, worker_timeout_s=300) as llm:
        assert len(llm.engine.worker_pids()) == 2  # world = tp·pcp = 1·2
        params = SamplingParams(temperature=0, max_tokens=NEW)
        got = [[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
               for prompts in ROUNDS]
        hits = llm.engine.report()["prefix_cache"]["hit_tokens"]
    hf = load_model(path, "float32")
    assert got == [[hf_greedy(hf, p, NEW) for p in prompts] for prompts in ROUNDS]
    assert hits >= 16  # the shared prefix's blocks, read from the PCP-written, DCP-sharded latent cache
