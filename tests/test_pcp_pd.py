"""P/D with a PCP producer: after a PCP prefill each of the ``tp·pcp`` ranks holds the tokens its
DCP rank owns, so the producer's KV moves by the same plan as a DCP producer's once its ranks are
placed in attention order ``t·pcp + p``. The rank -> shard mapping by hand, and the hand-over in one
process (emulated PCP producer, DCP consumers) against HF ``generate`` on the same weights."""

from __future__ import annotations

import pytest
from pcp_models import pcp_model
from pd_moves import move

import dcpgraph
from dcpgraph.serving.kv_connector.plan import KVSide, transfer_plan
from dcpgraph.testing.generation import drain, hf_greedy

F64 = "torch.float64"


def _gqa(tp, pcp, dcp, heads):
    """A 2-KV-head side with ``heads`` KV heads per rank (k and v caches of dim 8)."""
    caches = (("k", "k", heads, 8, F64), ("v", "v", heads, 8, F64))
    return KVSide(tp, dcp, 1, 4, "gqa", 2, caches, pcp=pcp)


def _plan(producer, consumer, end):
    return {(p.src, p.dst): p.units.tolist() for p in transfer_plan(producer, consumer, 0, end)}


def test_pcp_side_ranks_hold_heads_and_tokens_in_attention_order():
    # tp=2, pcp=2, dcp=2, 2 KV heads: global rank p·2 + t holds KV head t; the DCP group of head t
    # is its two PCP ranks (t, 2 + t), attention order t·2 + p, so rank 2 + t owns the odd tokens.
    side = _gqa(2, 2, 2, 1)
    assert [side.head_range(r, 0) for r in range(4)] == [(0, 1), (1, 2), (0, 1), (1, 2)]
    assert [side.dcp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    to_tp2 = _plan(side, _gqa(2, 1, 1, 1), 6)  # consumer tp=2, dcp=1: rank t holds head t, all tokens
    assert to_tp2 == {(0, 0): [0, 2, 4], (2, 0): [1, 3, 5], (1, 1): [0, 2, 4], (3, 1): [1, 3, 5]}
    to_tp1 = _plan(side, _gqa(1, 1, 1, 2), 4)  # consumer tp=1: both heads from both replica sets
    assert to_tp1 == {(0, 0): [0, 2], (2, 0): [1, 3], (1, 0): [0, 2], (3, 0): [1, 3]}
    # tp=1, pcp=2, dcp=1: both ranks hold everything; only the first (rank 0) sends, whole blocks
    # (dcp = 1 on both sides, same block size): runs 0 and 1 of 4 tokens
    assert _plan(_gqa(1, 2, 1, 2), _gqa(1, 1, 1, 2), 7) == {(0, 0): [0, 1]}
    # MLA, tp=2, pcp=2, dcp=4: one latent head on all four ranks, DCP rank = t·2 + p
    mla = KVSide(2, 4, 1, 4, "mla", 1, (("kv", "kv", 1, 8, F64),), pcp=2)
    assert [mla.dcp_rank(r) for r in range(4)] == [0, 2, 1, 3]
    to_mla = _plan(mla, KVSide(1, 1, 1, 4, "mla", 1, (("kv", "kv", 1, 8, F64),)), 8)
    assert to_mla == {(0, 0): [0, 4], (2, 0): [1, 5], (1, 0): [2, 6], (3, 0): [3, 7]}
    assert KVSide.from_json(mla.to_json()) == mla


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54]]
NEW = 6


def _hand_over(tp, pcp, dcp, consumers):
    model = pcp_model("qwen3")
    refs = [hf_greedy(model, p, NEW) for p in PROMPTS]
    producer = dcpgraph.compile(model, tp=tp, pcp=pcp, dcp=dcp, block_size=4, max_num_batched_tokens=8,
                                backend="eager")
    for config in consumers:
        consumer = dcpgraph.compile(model, block_size=4, backend="eager", **config)
        for prompt, ref in zip(PROMPTS, refs):
            rid, first, start, moved, _ = move(producer, consumer, prompt, NEW)
            assert start == 0 and moved > 0
            assert first + drain(consumer)[rid] == ref, (tp, pcp, dcp, config)
        assert consumer.scheduler.prompt_tokens_computed == 0  # nothing received was recomputed


@pytest.mark.slow  # an emulated 4-rank producer and two consumers: ~25 s on 2 loaded cores
def test_pcp_producer_hands_its_kv_to_dcp_consumers_equal_to_hf():
    # (2,2,2): global rank != attention index, so a plan by global rank would mix the heads' tokens;
    # consumers: tp=2 (row mode) and tp=4, dcp=2 with interleave == block_size (whole blocks)
    _hand_over(2, 2, 2, [dict(tp=2), dict(tp=4, dcp=2, interleave=4)])


@pytest.mark.gloo
@pytest.mark.slow  # a server of two worker processes, one in process and the proxy: ~70-130 s on 2 loaded cores
def test_serve_pcp_producer_answers_and_hands_over_to_a_tp1_consumer_like_hf(checkpoints, tmp_path):
    """``dcpgraph serve -pcp 2 -dcp 2`` as a P/D producer: it answers the ``openai`` client on its own,
    and through ``dcpgraph proxy`` hands every request's KV to a tp=1 consumer that decodes like HF."""
    import openai

    from dcpgraph.checkpoints.model_dir import load_model, load_tokenizer
    from dcpgraph.testing.pd import SERVE_ARGS, kv_config, kv_stats, wait_kv_free
    from dcpgraph.testing.server import free_port, running_dcpgraph, running_server

    path = checkpoints["qwen3"]
    hf, tokenizer = load_model(path, "float64"), load_tokenizer(path)
    port = free_port()
    prompts = ["The future of AI is", "a b c d e f g h i j k l m n o p q r s t u v w x y z"]
    with running_server(path, *SERVE_ARGS, "-pcp", "2", "-dcp", "2", "--max-num-batched-tokens", "8",
                        "--kv-transfer-config", kv_config("kv_producer", 0, 2, port),
                        log_path=str(tmp_path / "p.log")) as producer, \
            running_server(path, *SERVE_ARGS, "--kv-transfer-config", kv_config("kv_consumer", 1, 2, port),
                           log_path=str(tmp_path / "d.log")) as consumer, \
            running_dcpgraph("proxy", "--prefill", producer.url, "--decode", consumer.url,
                             log_path=str(tmp_path / "proxy.log")) as proxy:
        direct = openai.OpenAI(base_url=producer.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for prompt in ("héllo wörld héllo wörld héllo",):  # the PCP server on its own, no P/D in the request
            want = tokenizer.decode(hf_greedy(hf, tokenizer.encode(prompt), 8), skip_special_tokens=True)
            assert direct.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0).choices[0].text == want
        api = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        crossing = 0  # requests whose KV crosses (not when the first token is the EOS: the producer ends them)
        for prompt in prompts:
            ids = tokenizer.encode(prompt)
            ref = hf_greedy(hf, ids, 8)
            crossing += int(ref[:1] != [tokenizer.eos_token_id])
            want = tokenizer.decode(ref, skip_special_tokens=True)
            assert api.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0).choices[0].text == want
        wait_kv_free(producer, consumer)
        received, sent = kv_stats(consumer), kv_stats(producer)
    assert crossing > 0 and received["transfers_received"] == crossing and received["failures"] == 0
    assert received["prompt_tokens_computed"] == 0  # the consumer decoded from the PCP producer's KV only
    assert sent["transfers_sent"] == crossing
