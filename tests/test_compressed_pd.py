"""DeepSeek-V4 across engines and from cached prefixes at dcp > 1 (emulated).

P/D in one process: a request prefilled on one engine continues on another mesh. Its raw-window
rows travel by token position, its entries and CSA's indexer keys by entry index (gathered from
the producer's owners, placed by the consumer's interleave rule on entry indices:
:mod:`dcpgraph.runtime.entry_placement`), and its open windows as recurrent state. Every V4
cache and window is whole on every rank (one K=V head, replicated compressors), so the two sides
may differ in tp as well as dcp, interleave and block size.

Prefix caching at tp2·dcp2: with every compress rate dividing ``block_size`` and the interleave
dividing ``block_size // m``, a cached virtual block holds exactly its own tokens' entries on the
ranks that own them; a hit restores the open windows kept at its last block boundary.

Reference: HF ``generate``'s greedy tokens on the same weights."""

from __future__ import annotations

from types import SimpleNamespace

import dsv4_models
import pytest

import dcpgraph
from dcpgraph.testing.generation import drain, hf_greedy

NEW = 6
PD_PROMPTS = [list(p) for p in dsv4_models.PROMPTS[1:]]  # 3, 11 and 23 tokens
BASE = list(dsv4_models.PROMPTS[3])
PREFIX_PROMPTS = [BASE, BASE[:18] + [3, 99, 41, 8], BASE[:20] + [77, 2]]  # share 18 and 20 tokens with BASE


@pytest.fixture(scope="module")
def v4():
    """The shared V4 export, HF's tokens, and two engines: tp1 (blocks of 4, 5-token prefill
    chunks: crossing window and entry boundaries) and tp2·dcp2 (blocks of 8, interleave 2: entries
    in runs of 2 per rank, prefix caching on)."""
    model, program = dsv4_models.traced(o_groups=4)
    return SimpleNamespace(
        pd_refs=[hf_greedy(model, p, NEW) for p in PD_PROMPTS],
        prefix_refs=[hf_greedy(model, p, NEW) for p in PREFIX_PROMPTS],
        one=dcpgraph.compile(program, tp=1, block_size=4, max_num_batched_tokens=5),
        group=dcpgraph.compile(program, tp=2, dcp=2, block_size=8, interleave=2, max_num_batched_tokens=8,
                               enable_prefix_caching=True))


@pytest.mark.slow  # the shared V4 export (~25 s once per process), two compiles and ~15 s of runs on 2 loaded cores
@pytest.mark.parametrize("producer, consumer", [("one", "group"), ("group", "one")])
def test_v4_request_prefilled_on_one_mesh_continues_on_another(v4, producer, consumer):
    p_engine, c_engine = getattr(v4, producer), getattr(v4, consumer)
    transfers = [p_engine.prefill(p, ignore_eos=True) for p in PD_PROMPTS]
    assert all(len(t.states) == p_engine.mesh.tp for t in transfers)  # the open windows, per producer rank
    assert p_engine.blocks.free_blocks == p_engine.blocks.num_blocks
    ids = [c_engine.continue_from(t, NEW, ignore_eos=True) for t in transfers]
    outputs = drain(c_engine)
    assert [list(t.tokens[t.prompt_len:]) + outputs[rid] for t, rid in zip(transfers, ids)] == v4.pd_refs
    assert c_engine.blocks.free_blocks == c_engine.blocks.num_blocks


@pytest.mark.slow  # shares the module's engines; the runs take ~10 s on 2 loaded cores
def test_v4_prefix_hits_at_dcp2_restore_open_windows_and_give_hf_tokens(v4):
    engine = v4.group
    engine.reset_prefix_cache()
    before = dict(engine.prefix_cache_report()), dict(engine.scheduler.state_prefix.stats)
    got = {0: engine.generate([PREFIX_PROMPTS[0]], NEW, ignore_eos=True)[0]}
    ids = [engine.add_request(p, max_new_tokens=NEW, ignore_eos=True) for p in PREFIX_PROMPTS[1:]]
    outputs = drain(engine)
    got.update({i + 1: outputs[rid] for i, rid in enumerate(ids)})
    assert [got[i] for i in range(len(PREFIX_PROMPTS))] == v4.prefix_refs
    report, stats = engine.prefix_cache_report(), engine.scheduler.state_prefix.stats
    assert report["hit_requests"] - before[0]["hit_requests"] == 2
    assert report["hit_tokens"] - before[0]["hit_tokens"] == 16 + 16  # one virtual block of 8·2 tokens each
    assert stats["restored"] - before[1]["restored"] == 2


def test_v4_side_states_its_entry_caches_and_replicated_open_windows():
    """An instance's side (``serving.kv_connector.plan``) names each entry cache with its compress
    rate and rows, and marks open windows as whole on every rank, so the connector moves entries by
    entry index and the windows across tp."""
    import torch

    from dcpgraph.errors import UnsupportedModelError
    from dcpgraph.program import CacheSpec
    from dcpgraph.serving.kv_connector.plan import KVSide

    facts = SimpleNamespace(architecture="DeepseekV4ForCausalLM", layer_kv_heads=(), attention="gqa",
                            num_kv_heads=1, extra={"compress_rates": {1: 4}})
    caches = (CacheSpec("compressed_kv_1", 1, "compressed_kv", 1, 32, torch.float64),
              CacheSpec("entries_1", 1, "compressed_entries", 1, 32, torch.float64, tokens_per_row=4))
    pools = (SimpleNamespace(name="open_window_1", shape=(8, 64), dtype=torch.float64, role="open_window"),)
    lowering = SimpleNamespace(sliding_caches=())
    engine = SimpleNamespace(program=SimpleNamespace(facts=facts, caches=caches, recurrent_states=pools, lowering=lowering),
                             mesh=SimpleNamespace(tp=1, dcp=1, pcp=1), interleave=1, block_size=4)
    side = KVSide.of_engine(engine)
    assert side.entries == (("entries_1", 4, 4),) and side.replicated_states
    assert KVSide.from_json(side.to_json()) == side
    hybrid = SimpleNamespace(**{**engine.__dict__, "program": SimpleNamespace(
        facts=facts, caches=caches[:1], lowering=lowering,
        recurrent_states=(SimpleNamespace(**{**pools[0].__dict__, "role": "ssm"}),))})
    assert not KVSide.of_engine(hybrid).replicated_states and KVSide.of_engine(hybrid).entries == ()
    windowed = SimpleNamespace(**{**engine.__dict__, "program": SimpleNamespace(
        **{**engine.program.__dict__, "lowering": SimpleNamespace(sliding_caches=("compressed_kv_1",))})})
    with pytest.raises(UnsupportedModelError, match="hybrid_kv_cache=True gives the sliding-window layers their own"):
        KVSide.of_engine(windowed)
