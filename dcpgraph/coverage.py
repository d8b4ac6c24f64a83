"""Coverage matrix: every causal-LM architecture of the installed transformers through dcpgraph.

``python -m dcpgraph.coverage [--only a,b,...] [--out docs/coverage.md] [--timeout 300]``

For each ``model_type`` in transformers' causal-LM auto mapping: build a tiny random fp64 model
(:data:`TINY` plus the per-architecture :data:`OVERRIDES`), take HF ``generate``'s greedy tokens,
then trace and compile with dcpgraph at tp=1 and at the largest valid DCP mesh of at most 4 ranks
(``(4,4)``, ``(4,2)``, ``(2,2)``, first valid) and compare the tokens. Each row is one of

* ``exact``: identical tokens at every mesh tested;
* ``refused: <reason>``: dcpgraph raised :class:`~dcpgraph.errors.DcpGraphError` (an
  unsupported feature or an invalid mesh) before generating a token;
* ``MISMATCH``: tokens differ (a silent mismatch: a bug);
* ``error: <type: message>``: anything else (a crash: a bug);
* ``not built: <reason>``: transformers itself could not build or run the tiny model (not a
  statement about dcpgraph).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from dataclasses import dataclass

import torch

PROMPT = (5, 9, 4, 77, 10, 11, 3)
NEW_TOKENS = 6
DCP_MESHES = ((4, 4), (4, 2), (2, 2))
TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=1, head_dim=8, max_position_embeddings=256, initializer_range=0.2,
    tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    moe_intermediate_size=32, num_experts=4, n_routed_experts=4, num_local_experts=4, num_experts_per_tok=2,
)
# A window shorter than PROMPT for every architecture whose config has one, so sliding layers
# really slide (set only where the config defines it: HF's cache reads ``config.sliding_window``
# even for models whose attention ignores it).
TINY_WINDOW = 4
# Per-architecture corrections where the common tiny values do not fit the config's constraints.
OVERRIDES: dict[str, dict] = {
    "deepseek_v2": dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=None,
                        topk_method="greedy", n_shared_experts=1, first_k_dense_replace=1, num_key_value_heads=8),
    "deepseek_v3": dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=24,
                        n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                        num_key_value_heads=8),
}
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


def tiny_model(model_type: str):
    import transformers as tf

    config = tf.AutoConfig.for_model(model_type, **{**TINY, **OVERRIDES.get(model_type, {})})
    if getattr(config, "sliding_window", None) is not None:
        config.sliding_window = TINY_WINDOW
    if getattr(config, "is_encoder_decoder", False):
        return None
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    if getattr(model.config, "_experts_implementation", None) == "grouped_mm":
        model.set_experts_implementation("eager")  # grouped_mm has no fp64 kernel
    return model


def _tokens(program, tp: int, dcp: int) -> list[int]:
    import dcpgraph
    from dcpgraph.testing.generation import drain

    engine = dcpgraph.compile(program, tp=tp, dcp=dcp, block_size=4, max_batched_tokens=8)
    engine.add_request(list(PROMPT), max_new_tokens=NEW_TOKENS)
    return drain(engine)[0]


def check(model_type: str, timeout: int = 300) -> Row:
    """One architecture's row (never raises)."""
    import dcpgraph
    from dcpgraph.errors import DcpGraphError
    from dcpgraph.mesh import Mesh
    from dcpgraph.testing.generation import hf_greedy

    row = Row(model_type)
    try:
        with _deadline(timeout):
            try:
                model = tiny_model(model_type)
                if model is None:
                    row.result = "refused: encoder-decoder, not a decoder-only causal LM"
                    return row
                want = hf_greedy(model, PROMPT, NEW_TOKENS)
            except Exception as exc:  # noqa: BLE001 - transformers' own failure, reported as such
                row.result = f"not built: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
                return row
            try:
                program = dcpgraph.trace(model)
                facts = program.facts
                row.attention = facts.attention
                meshes = [(1, 1)]
                for tp, dcp in DCP_MESHES:
                    try:
                        Mesh(tp, dcp).validate(attention=facts.attention, num_q_heads=facts.num_q_heads,
                                               num_kv_heads=facts.num_kv_heads, block_size=4)
                    except DcpGraphError:
                        continue
                    meshes.append((tp, dcp))
                    break
                tested = []
                for tp, dcp in meshes:
                    got = _tokens(program, tp, dcp)
                    if got != want:
                        row.mesh = ", ".join([*tested, f"tp{tp}·dcp{dcp}"])
                        row.result = f"MISMATCH at tp{tp}·dcp{dcp}"
                        return row
                    tested.append(f"tp{tp}·dcp{dcp}")
                    row.mesh = ", ".join(tested)
                row.result = "exact" if len(meshes) > 1 else "exact at tp1 only (no valid DCP mesh)"
            except DcpGraphError as exc:
                done = f"exact at {row.mesh}; " if row.mesh else ""
                row.result = f"{done}refused: {str(exc).splitlines()[0][:160]}"
    except _Timeout as exc:
        row.result = f"error: timeout {exc}"
    except Exception as exc:  # noqa: BLE001 - a crash is a result here
        row.result = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    return row


def to_markdown(rows: list[Row], command: str = "python -m dcpgraph.coverage") -> str:
    exact = sum(r.result == "exact" for r in rows)
    bad = [r for r in rows if not r.ok]
    lines = [
        "# Coverage matrix",
        "",
        f"Generated by `{command}` (tiny random fp64 configs, greedy tokens vs HF "
        "`generate`; tp=1 and the largest valid DCP mesh of at most 4 ranks).",
        "",
        f"{len(rows)} architectures: {exact} exact at tp=1 and under DCP, "
        f"{len(bad)} crashes or mismatches.",
        "",
        "| architecture | attention kind | mesh tested | result |",
        "|---|---|---|---|",
    ]
    for r in rows:
        result = r.result.replace("|", "\\|")
        lines.append(f"| {r.architecture} | {r.attention} | {r.mesh or '-'} | {result} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dcpgraph.coverage", description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types (default: every causal LM)")
    parser.add_argument("--out", default="docs/coverage.md")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per architecture")
    args = parser.parse_args(argv)
    types = args.only.split(",") if args.only else causal_lm_types()
    rows = []
    for model_type in types:
        row = check(model_type, args.timeout)
        print(f"{row.architecture:32s} {row.attention:4s} {row.mesh:22s} {row.result}", flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        shown = " ".join(["python -m dcpgraph.coverage", *(argv if argv is not None else sys.argv[1:])])
        f.write(to_markdown(rows, shown))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
