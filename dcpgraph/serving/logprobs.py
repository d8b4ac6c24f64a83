"""Per-token log-probabilities from the engine, in vLLM's and OpenAI's shapes.

The engine gives one entry per generated token (:func:`dcpgraph.runtime.sampling.token_logprobs`):
``{"logprob", "rank", "top": [[id, logprob], ...]}``, the sampled token's figures and the top-N,
most likely first. Token texts are ``tokenizer.decode([id])`` (special tokens included), one token
alone, as vLLM and OpenAI show them; two ids can share a text, and then OpenAI's completions
``top_logprobs`` (a text-keyed map) keeps the more likely one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from .outputs import Logprob


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([int(token)], skip_special_tokens=False)


def vllm_logprobs(tokenizer, token: int, entry: dict) -> dict[int, Logprob]:
    """vLLM's per-token map: the sampled token first, then the top-N (by rank)."""
    out = {int(token): Logprob(entry["logprob"], entry["rank"], token_text(tokenizer, token))}
    for rank, (tid, logprob) in enumerate(entry["top"], start=1):
        out.setdefault(int(tid), Logprob(logprob, rank, token_text(tokenizer, tid)))
    return out


def vllm_prompt_logprobs(tokenizer, prompt: Sequence[int], entries: Sequence[dict | None]) -> list:
    """vLLM's ``RequestOutput.prompt_logprobs``: ``None`` for the first prompt token (nothing
    precedes it), then each prompt token's map as :func:`vllm_logprobs` builds it."""
    return [None if entry is None else vllm_logprobs(tokenizer, token, entry)
            for token, entry in zip(prompt, entries, strict=True)]


def prompt_logprobs_json(tokenizer, prompt: Sequence[int], entries: Sequence[dict | None]) -> list:
    """vLLM's response field ``prompt_logprobs``: ``null``, then per prompt token
    ``{"<id>": {"logprob", "rank", "decoded_token"}}`` (the token and the top-N)."""
    return [None if entry is None else {str(t): asdict(lp) for t, lp in entry.items()}
            for entry in vllm_prompt_logprobs(tokenizer, prompt, entries)]


def completion_logprobs(tokenizer, tokens: Sequence[int], entries: Sequence[dict | None],
                        offset: int) -> tuple[dict, int]:
    """OpenAI completions ``logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset``) for consecutive tokens whose first starts at character ``offset`` of the
    completion; returns it and the offset after the last token. An entry ``None`` (an echoed
    prompt's first token) has ``null`` logprob and top-N, as vLLM gives it."""
    texts, offsets, tops = [], [], []
    for token, entry in zip(tokens, entries, strict=True):
        text = token_text(tokenizer, token)
        texts.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for tid, logprob in entry["top"]:
            top.setdefault(token_text(tokenizer, tid), logprob)
        tops.append(top)
    return {"tokens": texts, "token_logprobs": [None if e is None else e["logprob"] for e in entries],
            "top_logprobs": tops, "text_offset": offsets}, offset


def _chat_token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer, tokens: Sequence[int], entries: Sequence[dict]) -> dict:
    """OpenAI chat ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
    [{"token", "logprob", "bytes"}, ...]}, ...]}``."""
    content = []
    for token, entry in zip(tokens, entries, strict=True):
        item = _chat_token(token_text(tokenizer, token), entry["logprob"])
        item["top_logprobs"] = [_chat_token(token_text(tokenizer, tid), lp) for tid, lp in entry["top"]]
        content.append(item)
    return {"content": content}
