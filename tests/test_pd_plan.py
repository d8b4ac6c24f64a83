"""The P/D transfer plan, by hand over ranks in one process: every (producer rank, consumer rank)
buffer is gathered from the producer's caches and scattered into the consumer's (what the
connector moves between processes), for different dcp, different tp (KV heads re-split), block and
row mode, a consumer prefix hit, and fp8 caches. Reference: HF ``generate`` on the same weights."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from pd_moves import move as hand_over

import dcpgraph
from dcpgraph.models import build_model
from dcpgraph.runtime.kv_transfer import export_kv
from dcpgraph.serving.kv_connector.plan import KVSide, check_compatible
from dcpgraph.testing.generation import drain, hf_greedy

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53]]
NEW = 8


def _gqa4():
    """A Llama with 4 KV heads, so tp 1/2/4 hold 4/2/1 heads per rank (re-split on transfer)."""
    config = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config).to(torch.float64).eval()


@pytest.fixture(scope="module", params=["gqa4", "deepseek_v2"])
def model(request):
    m = _gqa4() if request.param == "gqa4" else build_model("deepseek_v2", dtype=torch.float64)
    return request.param, m, dcpgraph.trace(m), [hf_greedy(m, p, NEW) for p in PROMPTS]


def move(p_engine, c_engine, prompt, new=NEW):
    return hand_over(p_engine, c_engine, prompt, new)


def fit(name, config):
    """``config`` for the model: the 4-KV-head GQA model needs tp=8 for dcp=2 (tp // 4 >= dcp)."""
    return {**config, "tp": 8} if name == "gqa4" and config.get("dcp", 1) > 1 else config


PAIRS = [
    (dict(tp=2, dcp=1, block_size=4), dict(tp=2, dcp=2, interleave=4, block_size=4)),  # block mode, dcp 1 -> 2
    (dict(tp=2, dcp=1, block_size=4), dict(tp=2, dcp=2, interleave=1, block_size=4)),  # row mode
    (dict(tp=1, block_size=8), dict(tp=2, dcp=1, block_size=4)),  # other tp and block size
    (dict(tp=4, dcp=1, block_size=4), dict(tp=2, dcp=1, block_size=4)),  # tp 4 -> 2
]


@pytest.mark.parametrize("prefill, decode", PAIRS)
def test_consumer_continues_equal_to_hf(model, prefill, decode):
    name, _, program, refs = model
    p_engine = dcpgraph.compile(program, **prefill)
    c_engine = dcpgraph.compile(program, **fit(name, decode))
    for prompt, ref in zip(PROMPTS, refs):
        c_rid, first, start, moved, blocks = move(p_engine, c_engine, prompt)
        assert start == 0 and moved > 0
        out = drain(c_engine)
        assert first + out[c_rid] == ref, (prompt, prefill, decode)
    assert c_engine.scheduler.prompt_tokens_computed == 0  # nothing received was recomputed
    assert c_engine.blocks.free_blocks == c_engine.blocks.num_blocks


def test_block_mode_moves_whole_blocks_row_mode_only_rows(model):
    name, _, program, _ = model
    p = dcpgraph.compile(program, tp=2, dcp=1, block_size=4)
    sizes = {}
    for interleave in (4, 1):
        c = dcpgraph.compile(program, **fit(name, dict(tp=2, dcp=2, interleave=interleave, block_size=4)))
        _, _, _, moved, blocks = move(p, c, PROMPTS[2])  # 14 tokens: 3 full blocks and 2 rows
        assert blocks == (interleave == 4)
        sizes[interleave] = moved
        drain(c)
    assert sizes[4] * 14 == sizes[1] * 16  # whole blocks carry the last block's unwritten tail


def test_consumer_prefix_hit_skips_received_blocks(model):
    name, m, program, _ = model
    p = dcpgraph.compile(program, tp=2, dcp=1, block_size=4, enable_prefix_caching=True)
    c = dcpgraph.compile(program, **fit(name, dict(tp=2, dcp=2, interleave=4, block_size=4)), enable_prefix_caching=True)
    shared = list(range(60, 80))
    for tail in ([90, 91, 92], [93, 94]):
        prompt = shared + tail
        c_rid, first, start, moved, _ = move(p, c, prompt)
        assert first + drain(c)[c_rid] == hf_greedy(m, prompt, NEW)
    assert start == 16 and c.scheduler.prompt_tokens_computed == 0  # two 8-token virtual blocks hit


def test_fp8_caches_move_as_bytes_with_their_scales():
    program = dcpgraph.trace(build_model("llama", dtype=torch.float32))
    p = dcpgraph.compile(program, tp=2, dcp=1, block_size=4, kv_cache_dtype="fp8_e4m3")
    c = dcpgraph.compile(program, tp=2, dcp=2, interleave=1, block_size=4, kv_cache_dtype="fp8_e4m3")
    assert any("scale" in spec.role for spec in c.program.caches)
    rid = p.add_request(PROMPTS[0], 2)
    while not p.scheduler.get(rid).output:
        p.step()
    want = export_kv(p, p.scheduler.get(rid))
    p.abort(rid)
    c_rid, _, _, _, _ = move(p, c, PROMPTS[0])
    got = export_kv(c, c.scheduler.get(c_rid))
    for mine, theirs in zip(got.caches, want.caches):
        for name in mine:
            assert torch.equal(mine[name].view(torch.uint8) if mine[name].dtype == torch.float8_e4m3fn else mine[name],
                               theirs[name].view(torch.uint8) if theirs[name].dtype == torch.float8_e4m3fn else theirs[name])


def test_incompatible_sides_are_refused():
    a = KVSide(2, 1, 1, 4, "gqa", 4, (("k", "k", 2, 16, "torch.float64"),))
    b = KVSide(2, 1, 1, 4, "gqa", 4, (("k", "k", 2, 16, "torch.float32"),))
    with pytest.raises(ValueError, match="cache 0 differs"):
        check_compatible(a, b)
