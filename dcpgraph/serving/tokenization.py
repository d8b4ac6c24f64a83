"""vLLM's ``/tokenize`` and ``/detokenize`` bodies (``entrypoints/openai/protocol.py``).

``/tokenize`` takes the completions form (``prompt``, ``add_special_tokens`` default true) or the
chat form (``messages`` through the chat template, ``add_special_tokens`` default false, as the
template writes them) and answers ``{"count", "max_model_len", "tokens", "token_strs"}``
(``token_strs`` only with ``return_token_strs``). ``/detokenize`` takes ``{"tokens": [...]}`` and
answers ``{"prompt": text}``. Unknown fields are ignored and logged, as in :mod:`.protocol`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from .prompts import Prompt
from .protocol import ChatMessage, LenientModel


class TokenizeCompletionRequest(LenientModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(LenientModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        return {**(self.chat_template_kwargs or {}), "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}


class DetokenizeRequest(LenientModel):
    model: str | None = None
    tokens: list[int]


def tokenize_request(tokenizer, body, chat: Prompt | None, max_model_len: int) -> dict:
    """The ``/tokenize`` answer: ``chat`` is the rendered conversation for the chat form (its text
    is encoded again only when ``add_special_tokens`` asks for the tokenizer's own specials)."""
    if chat is not None:
        ids = chat.token_ids if not body.add_special_tokens else list(tokenizer.encode(chat.text))
    else:
        ids = list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}
