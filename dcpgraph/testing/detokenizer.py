"""The detokenisation :class:`~dcpgraph.serving.detokenizer.TextStream` replaced, kept as the
reference its incremental decoders are checked (and benchmarked) against, and tokenizers that
exercise them."""

from __future__ import annotations


class WholeDecoder:
    """Decodes every id pushed so far at each step (``O(n)`` per token): ``text`` is
    ``tokenizer.decode(ids, skip_special_tokens=...)`` by definition."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""

    def push(self, token: int) -> None:
        self.ids.append(int(token))
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)


class PythonDecodeTokenizer:
    """A tokenizer whose ``decode`` is plain Python (wrapping ``inner``'s), as a slow tokenizer's
    is: :func:`~dcpgraph.serving.detokenizer.incremental_decoder` must take the offsets path."""

    def __init__(self, inner):
        self.inner = inner

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)


def llama_like_tokenizer():
    """A ``PreTrainedTokenizerFast`` decoding as Llama 2's does (SentencePiece ``▁`` for spaces,
    ``<0xNN>`` byte fallback for characters it lacks, the first leading space stripped: a decode
    that depends on where the text starts), with a few merges and ``<s>``/``</s>`` specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "▁abcdefghijklmnopqrstuvwxyz.,!?"
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for ch in chars:
        vocab[ch] = len(vocab)
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("i", "n")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


def wordpiece_tokenizer():
    """A BERT-like ``PreTrainedTokenizerFast`` (WordPiece, ``##`` continuations) with
    ``clean_up_tokenization_spaces`` on, which transformers applies to WordPiece decodes: its
    ``decode`` is not its backend's, so the offsets path serves it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "the", "a", "cat", "do", "n", "'", "t", "##s", "##ing", ".", ",", "?", "!", "it", "is", "##n"]
    tok = Tokenizer(models.WordPiece(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("[CLS]", "[SEP]")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=True)
