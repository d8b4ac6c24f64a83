"""Per-token cost of streaming detokenisation: the whole-output decode per token that
``TextStream`` used to do (``O(n)`` per token) against its incremental decoders, at 1k and 4k
output tokens, in one run:

    python3 benchmarks/detokenize.py [--tokenizer DIR]

Tokenizers: the byte-level one of the test checkpoints (multi-byte characters span several
tokens) and a Llama-like one (byte fallback, SentencePiece spaces), or a real checkpoint's with
``--tokenizer``. Each stream gets the same ids (an encoded multilingual text) and must end with the
same text; printed: microseconds per token of each, and their ratio old/new.
"""

from __future__ import annotations

import argparse
import time

from dcpgraph.serving.detokenizer import TextStream, incremental_decoder
from dcpgraph.serving.params import SamplingParams
from dcpgraph.testing.checkpoints import byte_level_tokenizer
from dcpgraph.testing.detokenizer import WholeDecoder, llama_like_tokenizer

TEXT = "The decode context is split over ranks; héllo wörld, 日本語のテキスト, ünïcödé 🙂 and plain words. "


def per_token_us(tokenizer, ids: list[int], decoder) -> tuple[float, str]:
    """Microseconds per token to stream ``ids`` through a TextStream, and its text."""
    stream = TextStream(tokenizer, SamplingParams(max_tokens=None), decoder=decoder)
    start = time.perf_counter()
    for i, t in enumerate(ids):
        stream.add(t, i == len(ids) - 1)
    return (time.perf_counter() - start) / len(ids) * 1e6, stream.text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", help="a model directory whose tokenizer to use instead")
    args = parser.parse_args()
    if args.tokenizer:
        from dcpgraph.checkpoints.model_dir import load_tokenizer

        tokenizers = {args.tokenizer: load_tokenizer(args.tokenizer)}
    else:
        tokenizers = {"byte_level": byte_level_tokenizer(), "llama_like": llama_like_tokenizer()}
    print(f"{'tokenizer':<12} {'tokens':>6} {'decoder':<18} {'old us/tok':>10} {'new us/tok':>10} {'old/new':>8}")
    for name, tok in tokenizers.items():
        encoded = tok.encode(TEXT * 400)
        for n in (1024, 4096):
            ids = encoded[:n]
            assert len(ids) == n, f"{name}: the text encodes to only {len(encoded)} tokens"
            new_decoder = incremental_decoder(tok, True)
            new, new_text = per_token_us(tok, ids, new_decoder)
            old, old_text = per_token_us(tok, ids, WholeDecoder(tok, True))
            assert new_text == old_text
            print(f"{name:<12} {n:>6} {type(new_decoder).__name__:<18} {old:>10.1f} {new:>10.1f} {old / new:>8.1f}")


if __name__ == "__main__":
    main()
