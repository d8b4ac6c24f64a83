"""Prefill context parallelism (PCP): a prompt's new tokens split over ``pcp`` ranks.

:mod:`.split` is the head-tail (zigzag) split balanced for causal work, :mod:`.attention` the
per-rank prefill attention over every earlier key (cached context plus the exchanged new K/V,
merged by log-sum-exp), :mod:`.kv_placement` the write of the new K/V into the DCP layout,
:mod:`.eager` an eager PCP prefill and DCP decode of a transformers Llama/Qwen3 model on a
(tp, pcp, dcp) mesh (TP slices in :mod:`.tp_shard`), driven emulated (:mod:`.emulated`) or on
process groups (:mod:`.distributed`), :mod:`.generate` greedy generation on top, and
:mod:`.support` what the compiled engine refuses.
"""
