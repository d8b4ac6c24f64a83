"""Coverage matrix: every causal-LM architecture of the installed transformers through dcpgraph.

``python -m dcpgraph.coverage [--only a,b,...] [--out docs/coverage.md] [--timeout 300]``

For each ``model_type`` in transformers' causal-LM auto mapping: build a tiny random fp64 model
(:data:`TINY` plus the per-architecture :data:`OVERRIDES`), take HF ``generate``'s greedy tokens,
then trace and compile with dcpgraph at tp=1 and at the largest valid DCP mesh of at most 4 ranks
(``(4,4)``, ``(4,2)``, ``(2,2)``, first valid) and compare the tokens. Each row is one of

* ``exact``: identical tokens at every mesh tested;
* ``refused: <reason>``: dcpgraph raised :class:`~dcpgraph.errors.DcpGraphError` (an
  unsupported feature or an invalid mesh) before generating a token; a
  :class:`~dcpgraph.errors.VerificationError` (a pass broke an invariant) is a crash instead;
* ``MISMATCH``: tokens differ (a silent mismatch: a bug);
* ``error: <type: message>``: anything else (a crash: a bug);
* ``not built: <reason>``: transformers itself could not build or run the tiny model (not a
  statement about dcpgraph).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import sys
from dataclasses import dataclass

import torch

import dcpgraph
from dcpgraph.errors import DcpGraphError, UnsupportedModelError, VerificationError
from dcpgraph.frontends.compressed_layers import compressed_layer_indices
from dcpgraph.frontends.layer_kinds import check_layer_types
from dcpgraph.frontends.recurrent_layers import declared_recurrent_layers, declared_stateless_layers
from dcpgraph.mesh import Mesh
from dcpgraph.testing.generation import drain, hf_greedy

PROMPT = (5, 9, 4, 77, 10, 11, 3)
NEW_TOKENS = 6
DCP_MESHES = ((4, 4), (4, 2), (2, 2))
TP_MESHES = ((4, 1), (2, 1))  # tested when no DCP mesh is valid (multi-head attention, say)
TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=1, head_dim=8, max_position_embeddings=256, initializer_range=0.2,
    tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    rotary_dim=8, moe_intermediate_size=32, num_experts=4, n_routed_experts=4, num_local_experts=4, num_experts_per_tok=2,
)
# Latent-attention (MLA) dims, for every config that has ``kv_lora_rank``.
TINY_MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, qk_head_dim=24, v_head_dim=16,
                q_lora_rank=24, num_key_value_heads=8, n_group=1, topk_group=1, n_shared_experts=1,
                first_k_dense_replace=1)
# A window shorter than PROMPT for every architecture whose config has one, so sliding layers
# really slide (set only where the config defines it: HF's cache reads ``config.sliding_window``
# even for models whose attention ignores it).
TINY_WINDOW = 4
# Per-architecture corrections where the common tiny values do not fit the config's constraints.
OVERRIDES: dict[str, dict] = {
    "deepseek_v2": dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=None,
                        topk_method="greedy", n_shared_experts=1, first_k_dense_replace=1, num_key_value_heads=8),
    "diffllama": dict(num_key_value_heads=2),  # its differential attention needs an even count
    # DeepSeek-V4: a sliding layer, an HCA and a CSA layer with rates, window and top-k small enough
    # that the 13-token run emits entries, slides and selects (the default rates 4 and 128 and top-512
    # would leave HCA empty and select every entry); a 32-wide head with an 8-wide rope slice.
    "deepseek_v4": dict(num_hidden_layers=3, head_dim=32, partial_rotary_factor=0.25, q_lora_rank=24,
                        o_groups=4, o_lora_rank=16, index_n_heads=4, index_head_dim=16, index_topk=2,
                        layer_types=["sliding_attention", "heavily_compressed_attention",
                                     "compressed_sparse_attention"],
                        mlp_layer_types=["hash_moe", "moe", "moe"],
                        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4}),
    "dots1": dict(n_shared_experts=1),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),  # the default leaves it None
    # Hybrids with gated delta nets: the default interval of 4 leaves two layers without attention,
    # which HF's own cache cannot generate with; small linear-attention heads.
    **{arch: dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
       for arch in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")},
    # Mamba-2 hybrids: 16 heads of 8 (= mamba_expand·hidden), 2 groups of B/C with state 8, a scan
    # chunk of 4 so that the prompt spans several; one Mamba-2 layer beside attention (nemotron_h
    # also an MLP and a MoE layer).
    **{arch: dict(mamba_n_heads=16, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=4,
                  **extra)
       for arch, extra in (("bamba", dict(attn_layer_indices=[1])),
                           ("granitemoehybrid", dict(layer_types=["mamba", "attention"])),
                           ("falcon_h1", dict(mamba_d_ssm=128)))},
    # Kimi delta attention hybrids: one KDA layer (4 heads of 8 in kimi_linear; bailing_hybrid's KDA
    # heads are its 8 attention heads of head_dim 8) beside one MLA layer.
    "kimi_linear": dict(layer_types=["linear_attention", "full_attention"], linear_num_heads=4, linear_head_dim=8),
    "bailing_hybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "nemotron_h": dict(hybrid_override_pattern="M*-E", num_hidden_layers=4, mamba_num_heads=16, mamba_head_dim=8,
                       n_groups=2, ssm_state_size=8, chunk_size=4, n_group=1, topk_group=1,
                       moe_shared_expert_intermediate_size=32),
    "gemma3n_text": dict(num_kv_shared_layers=0, layer_types=["sliding_attention", "full_attention"]),
    "reformer": dict(axial_pos_embds_dim=[32, 32], axial_pos_shape=[16, 16]),
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=TINY_WINDOW),
    "deepseek_v3": dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=24,
                        n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                        num_key_value_heads=8),
}
_TEXT_SUB_CONFIGS = frozenset({"text_config", "attn_config", "ffn_config"})
FAST_SUBSET = ("llama", "qwen2", "qwen3_moe", "gemma2", "phi3")


@dataclass
class Row:
    architecture: str
    attention: str = "?"
    mesh: str = ""
    result: str = ""

    @property
    def ok(self) -> bool:
        return not (self.result.startswith("MISMATCH") or self.result.startswith("error"))


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: int):
    def fire(*_):
        raise _Timeout(f"over {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _known(config_class, values: dict) -> dict:
    """The entries of ``values`` that ``config_class`` defines (directly or via its
    ``attribute_map``): an unknown key would become a stray attribute that the model ignores but
    dcpgraph's facts would read (e.g. ``num_key_value_heads`` on a multi-head-only config)."""
    default = config_class()
    out = {}
    for key, value in values.items():
        prop = getattr(config_class, key, None)
        if isinstance(prop, property) and prop.fset is None:
            continue  # derived from other fields (e.g. falcon's head_dim)
        try:
            getattr(default, key)
        except Exception:  # noqa: BLE001 - absent, or per-layer (no single value to override)
            continue
        out[key] = value
    return out


def tiny_config(model_type: str):
    """The tiny random config of ``model_type``, or a string saying why it is not a decoder-only
    text causal LM (then nothing is built)."""
    import transformers as tf


    config_class = type(tf.AutoConfig.for_model(model_type))
    default = config_class()
    if getattr(default, "is_encoder_decoder", False):
        return "encoder-decoder, not a decoder-only causal LM"
    subs = {k for k in (getattr(config_class, "sub_configs", None) or {}) if k not in _TEXT_SUB_CONFIGS}
    if subs:
        return (f"composite model ({', '.join(sorted(subs))}), not a single text decoder; its text "
                "model is walked under its own model type where transformers registers one")
    try:  # the model kind itself, before tiny values that its validators may reject
        text_default = default.get_text_config() if hasattr(default, "get_text_config") else default
        check_layer_types(text_default, declared_recurrent_layers(text_default)
                          + declared_stateless_layers(text_default) + compressed_layer_indices(text_default))
    except UnsupportedModelError as exc:
        return str(exc)
    mla = TINY_MLA if _declares(default, "kv_lora_rank") else {}
    values = {**TINY, **mla, **OVERRIDES.get(model_type, {})}
    known = _known(config_class, values)
    text = getattr(default, "text_config", None)
    if text is not None and text is not default:  # a wrapper around a text config: shrink that one
        known["text_config"] = _tiny_text(type(text)(**_known(type(text), values)))
    return _tiny_text(tf.AutoConfig.for_model(model_type, **known))


def _declares(config, name: str) -> bool:
    """Whether ``config`` sets ``name``, globally or per layer (a heterogeneous config raises on
    the global read of a per-layer attribute)."""
    if name in (getattr(config, "per_layer_attributes", None) or ()):
        return True
    return getattr(config, name, None) is not None


def _tiny_text(config):
    if getattr(config, "sliding_window", None) is not None:
        config.sliding_window = TINY_WINDOW
    if hasattr(config, "is_decoder"):
        config.is_decoder = True  # encoder families' LM heads are causal only as decoders
    return config


def tiny_model(model_type: str):
    import transformers as tf

    config = tiny_config(model_type)
    if isinstance(config, str):
        return config
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    return model


def _tokens(program, tp: int, dcp: int) -> list[int]:
    engine = dcpgraph.compile(program, tp=tp, dcp=dcp, block_size=4, max_num_batched_tokens=8)
    engine.add_request(list(PROMPT), max_new_tokens=NEW_TOKENS)
    return drain(engine)[0]


def check(model_type: str, timeout: int = 300) -> Row:
    """One architecture's row (never raises)."""
    row = Row(model_type)
    model = None
    try:
        with _deadline(timeout):
            try:
                model = tiny_model(model_type)
            except _Timeout:
                raise
            except Exception as exc:  # noqa: BLE001 - transformers' own failure, reported as such
                row.result = f"not built: {_first_line(exc)}"
                return row
            if isinstance(model, str):
                row.result = f"refused: {model}"
                return row
            try:
                program = dcpgraph.trace(model)  # dcpgraph's verdict first: a refusal needs no HF run
                facts = program.facts
                row.attention = facts.attention
                try:
                    want = hf_greedy(model, PROMPT, NEW_TOKENS)
                except _Timeout:
                    raise
                except Exception as exc:  # noqa: BLE001 - transformers' own failure, reported as such
                    row.result = f"not built: HF generate failed: {_first_line(exc)}"
                    return row
                meshes = [(1, 1), *_largest_valid_mesh(facts)]
                tested = []
                for tp, dcp in meshes:
                    got = _tokens(program, tp, dcp)
                    if got != want:
                        row.mesh = ", ".join([*tested, f"tp{tp}·dcp{dcp}"])
                        row.result = f"MISMATCH at tp{tp}·dcp{dcp}"
                        return row
                    tested.append(f"tp{tp}·dcp{dcp}")
                    row.mesh = ", ".join(tested)
                if meshes[-1][1] > 1:
                    row.result = "exact"
                else:
                    row.result = (f"exact without DCP: no DCP mesh of at most 4 ranks is valid for "
                                  f"{facts.num_q_heads} query / {facts.num_kv_heads} KV heads")
            except DcpGraphError as exc:
                if isinstance(exc, VerificationError):  # an invariant broke: a bug, not a refusal
                    raise
                done = f"exact at {row.mesh}; " if row.mesh else ""
                row.result = f"{done}refused: {str(exc).splitlines()[0][:160]}"
    except _Timeout as exc:
        row.result = f"error: timeout {exc}"
    except Exception as exc:  # noqa: BLE001 - a crash is a result here
        row.result = f"error: {_first_line(exc)}"
        if not row.mesh and _hf_fails(model):  # transformers cannot run its own tiny model either
            row.result = f"not built: HF generate failed too; dcpgraph: {_first_line(exc)}"
    return row


def _hf_fails(model) -> bool:
    try:
        with _deadline(120):
            hf_greedy(model, PROMPT, NEW_TOKENS)
    except Exception:  # noqa: BLE001 - any failure of transformers' own generate
        return True
    return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0][:120] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def _largest_valid_mesh(facts) -> list[tuple[int, int]]:
    """The first valid mesh of :data:`DCP_MESHES`, else of :data:`TP_MESHES` (``[]`` if none)."""
    for tp, dcp in (*DCP_MESHES, *TP_MESHES):
        try:
            Mesh(tp, dcp).validate(attention=facts.attention, num_q_heads=facts.num_q_heads,
                                   num_kv_heads=facts.num_kv_heads, block_size=4,
                                   layer_kv_heads=facts.layer_kv_heads)
        except DcpGraphError:
            continue
        return [(tp, dcp)]
    return []


def to_markdown(rows: list[Row], command: str = "python -m dcpgraph.coverage", updates: tuple[str, ...] = ()) -> str:
    """The table; ``updates``: commands that re-ran some rows in place (``--update``), shown."""
    exact = sum(r.result == "exact" for r in rows)
    exact_tp = sum(r.result.startswith("exact without DCP") for r in rows)
    refused = sum("refused:" in r.result for r in rows)
    not_built = sum(r.result.startswith("not built") for r in rows)
    bad = [r for r in rows if not r.ok]
    lines = [
        "# Coverage matrix",
        "",
        f"Generated by `{command}` (tiny random fp64 configs, greedy tokens vs HF "
        "`generate`; tp=1 and the largest valid DCP mesh of at most 4 ranks).",
        *(f"Rows re-run in place by `{u}`." for u in updates),
        "",
        f"{len(rows)} architectures: {exact} exact at tp=1 and under DCP; {exact_tp} exact at tp=1 "
        f"and under TP (no valid DCP mesh); {refused} refused with a named reason (some after an "
        f"exact tp=1 run); {not_built} not built by transformers itself; {len(bad)} crashes or "
        "mismatches.",
        "",
        "| architecture | attention kind | mesh tested | result |",
        "|---|---|---|---|",
    ]
    for r in rows:
        result = r.result.replace("|", "\\|")
        lines.append(f"| {r.architecture} | {r.attention} | {r.mesh or '-'} | {result} |")
    return "\n".join(lines) + "\n"


_ROW = re.compile(r"^\| (\S+) \| (\S+) \| (.+?) \| (.*) \|$")


def from_markdown(text: str) -> tuple[str, tuple[str, ...], list[Row]]:
    """``(command, updates, rows)`` of a table written by :func:`to_markdown`."""
    command = re.search(r"Generated by `([^`]*)`", text).group(1)
    updates = tuple(re.findall(r"Rows re-run in place by `([^`]*)`", text))
    rows = []
    for line in text.splitlines():
        m = _ROW.match(line)
        if m and m.group(1) not in ("architecture", "---"):
            arch, attention, mesh, result = m.groups()
            rows.append(Row(arch, attention, "" if mesh == "-" else mesh, result.replace("\\|", "|")))
    return command, updates, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dcpgraph.coverage", description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types (default: every causal LM)")
    parser.add_argument("--out", default="docs/coverage.md")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per architecture")
    parser.add_argument("--update", action="store_true",
                        help="re-run only the --only rows (default: every crash, mismatch or timeout) of the "
                             "existing --out table and replace them in place")
    args = parser.parse_args(argv)
    shown = " ".join(["python -m dcpgraph.coverage", *(argv if argv is not None else sys.argv[1:])])
    command, updates, old = shown, (), []
    if args.update:
        with open(args.out) as f:
            command, updates, old = from_markdown(f.read())
        updates = (*updates, shown)
    if args.only:
        types = args.only.split(",")
    elif args.update:
        types = [r.architecture for r in old if not r.ok or "_Timeout" in r.result]
    else:
        types = causal_lm_types()
    rows = {r.architecture: r for r in old}
    for model_type in types:
        row = check(model_type, args.timeout)
        print(f"{row.architecture:32s} {row.attention:4s} {row.mesh:22s} {row.result}", flush=True)
        rows[model_type] = row
    with open(args.out, "w") as f:
        f.write(to_markdown(list(rows.values()), command, updates))
    return 0 if all(r.ok for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
