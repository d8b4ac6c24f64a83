"""Attention layers of different shapes in one model: Gemma-4 text (global layers with their own
head dim, and with ``attention_k_eq_v`` their own KV head count and values computed from the key
projection; with KV sharing, later layers reading earlier layers' K/V) and MiMo-V2-Flash (sliding layers with twice the full layers' KV heads, values of
their own width, attention sinks, routed experts). Tiny random fp64 models with transformers'
defaults give HF ``generate``'s greedy tokens at tp1 and on the DCP meshes valid for every layer
(emulated ranks), for a prompt longer than the sliding window and the prefill chunk; a mesh one
layer cannot take is refused naming that layer and the dcp values every layer allows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import dcpgraph  # noqa: E402
from dcpgraph.capacity import bytes_per_block, cache_shapes  # noqa: E402
from dcpgraph.errors import ConfigError  # noqa: E402
from dcpgraph.testing.generation import drain, hf_greedy  # noqa: E402

WINDOW = 4
PROMPT = (5, 9, 4, 77, 10, 11, 3, 40, 41, 42, 8)  # 11 tokens: past the window and the 8-token chunk
NEW_TOKENS = 6


def gemma4(k_eq_v: bool, kv_heads: int = 2, shared: int = 0) -> torch.nn.Module:
    """Sliding layers: head dim 8, ``kv_heads`` KV heads; global layers: head dim 16 and
    (``k_eq_v``) one KV head whose values are the key projection's output, else ``kv_heads`` KV
    heads with their own values; the last ``shared`` layers reuse the K/V of the last earlier
    layer of their type (Gemma-4's KV sharing)."""
    import transformers

    config = transformers.Gemma4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=kv_heads, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
        attention_k_eq_v=k_eq_v, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=shared,
        sliding_window=WINDOW, vocab_size_per_layer_input=128, hidden_size_per_layer_input=8,
        max_position_embeddings=128, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=None,
        tie_word_embeddings=False,  # tied, the √hidden-scaled input embedding dominates: tokens just repeat
    )
    torch.manual_seed(0)
    return transformers.Gemma4ForCausalLM(config).to(torch.float64).eval()


def mimo() -> torch.nn.Module:
    """Full layers: one KV head; sliding layers: two, with sinks; values 16 wide, keys 8."""
    import transformers

    config = transformers.MiMoV2FlashConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=1, head_dim=8, v_head_dim=16, n_routed_experts=4,
        num_experts_per_tok=2, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        sliding_window=WINDOW, max_position_embeddings=128, initializer_range=0.2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(torch.float64).eval()


def greedy(program, tp: int, dcp: int) -> list[int]:
    return run(dcpgraph.compile(program, tp=tp, dcp=dcp, block_size=4, max_num_batched_tokens=8))


def run(engine) -> list[int]:
    rid = engine.add_request(list(PROMPT), max_new_tokens=NEW_TOKENS)
    return drain(engine)[rid]


@pytest.fixture(scope="module")
def gemma4_kv_shared():
    model = gemma4(k_eq_v=True)
    return model, dcpgraph.trace(model)


@pytest.fixture(scope="module")
def mimo_model():
    model = mimo()
    return model, dcpgraph.trace(model)


def test_facts_record_the_layers_that_differ(gemma4_kv_shared, mimo_model):
    assert gemma4_kv_shared[1].facts.layer_head_dims == (8, 16, 8, 16)
    assert gemma4_kv_shared[1].facts.layer_kv_heads == (2, 1, 2, 1)
    assert mimo_model[1].facts.layer_kv_heads == (1, 2, 2)
    assert mimo_model[1].facts.layer_head_dims == ()  # keys are 8 wide in every layer
    assert "# per attention layer: kv heads [2, 1, 2, 1], head dims [8, 16, 8, 16]" in dcpgraph.explain(
        gemma4_kv_shared[1])


@pytest.mark.parametrize("tp, dcp", [pytest.param(1, 1, marks=pytest.mark.slow), (4, 2)])
def test_gemma4_global_layers_with_their_own_kv_heads_match_hf(gemma4_kv_shared, tp, dcp):
    model, program = gemma4_kv_shared
    engine = dcpgraph.compile(program, tp=tp, dcp=dcp, block_size=4, max_num_batched_tokens=8)
    assert run(engine) == hf_greedy(model, PROMPT, NEW_TOKENS)
    shapes = {(c.layer, c.role): (c.heads, c.dim) for c in engine.program.caches}
    local_sliding = 2 // min(tp, 2)  # 2 sliding KV heads split over up to 2 rank groups; 1 global head
    assert shapes[(0, "k")] == (local_sliding, 8) and shapes[(1, "k")] == shapes[(1, "v")] == (1, 16)
    # Sizing sums each layer's own shape (fp64): 2 sliding layers' K and V, 2 global layers'.
    assert bytes_per_block(cache_shapes(engine.program.caches), 4) == 4 * 8 * 2 * (2 * local_sliding * 8 + 2 * 16)
    by_layer = engine.memory_report()["kv_bytes_per_block_by_layer"]
    assert by_layer == {0: 4 * 8 * 2 * local_sliding * 8, 1: 4 * 8 * 2 * 16, 2: 4 * 8 * 2 * local_sliding * 8,
                        3: 4 * 8 * 2 * 16}
    report = engine.memory_report()
    assert report["kv_bytes_per_rank"][0] == sum(by_layer.values()) * report["num_blocks"]


@pytest.mark.slow  # a third model traced and compiled: ~20 s
def test_gemma4_global_layers_with_their_own_head_dim_and_shared_kv_match_hf_at_tp2_dcp2():
    model = gemma4(k_eq_v=False, kv_heads=1, shared=2)
    assert model.config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    program = dcpgraph.trace(model)
    assert program.facts.layer_kv_heads == () and program.facts.layer_head_dims == (8, 16, 8, 16)
    assert greedy(program, 2, 2) == hf_greedy(model, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("tp, dcp", [pytest.param(1, 1, marks=pytest.mark.slow), (4, 2)])
def test_mimo_layers_with_doubled_kv_heads_match_hf(mimo_model, tp, dcp):
    model, program = mimo_model
    assert greedy(program, tp, dcp) == hf_greedy(model, PROMPT, NEW_TOKENS)


def test_a_mesh_one_layer_cannot_take_is_refused_naming_it(mimo_model, gemma4_kv_shared):
    with pytest.raises(ConfigError, match=r"layer 1 \(2 KV heads; the model's layers have \[1, 2\]\).*"
                                          r"Valid dcp at tp=2 for every layer: \[1\]"):
        dcpgraph.compile(mimo_model[1], tp=2, dcp=2, block_size=4)
    # Gemma-4's per-layer KV heads come from its config: refused before anything is traced.
    with pytest.raises(ConfigError, match=r"layer 0 \(2 KV heads.*Valid dcp at tp=4 for every layer: \[1, 2\]"):
        dcpgraph.compile(gemma4_kv_shared[0], tp=4, dcp=4, block_size=4)


def test_the_planner_refuses_layers_of_different_shapes_by_name():
    from dcpgraph.errors import UnsupportedModelError
    from dcpgraph.plan.model_shape import from_config

    gemma = gemma4(k_eq_v=True).config.to_dict()
    with pytest.raises(UnsupportedModelError, match=r"one KV head count and head dim.*per_layer_config"):
        from_config(gemma)
    with pytest.raises(UnsupportedModelError, match=r"twice the full layers' KV heads"):
        from_config(mimo().config.to_dict())


@pytest.mark.slow  # two more engines per model: ~30 s
@pytest.mark.parametrize("options", [{"hybrid_kv_cache": True}, {"enable_prefix_caching": True}])
def test_sliding_layer_pools_and_prefix_hits_keep_each_layers_shape(gemma4_kv_shared, mimo_model, options):
    for model, program in (gemma4_kv_shared, mimo_model):
        engine = dcpgraph.compile(program, tp=4, dcp=2, block_size=4, max_num_batched_tokens=8, **options)
        want = hf_greedy(model, PROMPT, NEW_TOKENS)
        assert run(engine) == want
        assert run(engine) == want  # with prefix caching: the second run starts from cached blocks
        if options.get("enable_prefix_caching"):
            assert engine.prefix_cache_report()["hit_tokens"] > 0


def test_kv_transfer_refuses_layers_with_different_kv_heads_by_name(mimo_model):
    from dcpgraph.errors import UnsupportedModelError
    from dcpgraph.serving.kv_connector.plan import KVSide

    engine = dcpgraph.compile(mimo_model[1], block_size=4)
    with pytest.raises(UnsupportedModelError, match=r"KV transfer between instances .* \[1, 2\]"):
        KVSide.of_engine(engine)


def test_a_checkpoint_directory_is_checked_per_layer_before_loading(tmp_path, gemma4_kv_shared):
    from dcpgraph.checkpoints.model_dir import inspect_checkpoint

    gemma4_kv_shared[0].save_pretrained(tmp_path)  # config.json names Gemma4ForCausalLM
    inspect_checkpoint(str(tmp_path), tp=4, dcp=2, block_size=4, load_format="dummy")
    with pytest.raises(ConfigError, match=r"layer 0 \(2 KV heads.*Valid dcp at tp=4 for every layer: \[1, 2\]"):
        inspect_checkpoint(str(tmp_path), tp=4, dcp=4, block_size=4, load_format="dummy")
