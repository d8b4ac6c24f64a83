"""Prompts in the forms vLLM's ``LLM.generate`` accepts, turned into token ids.

A prompt is a string, ``{"prompt": str}``, ``{"prompt_token_ids": [int, ...]}`` or a list of ints;
``generate`` takes one prompt or a list of them (a list of ints is *one* token-id prompt, a list of
lists of ints is several).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    text: str | None
    token_ids: list[int]


def _is_token_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)) or _is_token_list(prompts):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise TypeError(f"prompts must be a string, a dict, a list of token ids or a list of these, got {type(prompts).__name__}")


def encode_prompt(tokenizer, prompt, *, add_special_tokens: bool = True) -> Prompt:
    if isinstance(prompt, str):
        return Prompt(prompt, list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens)))
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown:
            raise TypeError(f"unknown prompt keys {sorted(unknown)}; use 'prompt' or 'prompt_token_ids'")
        if "prompt_token_ids" in prompt:
            return Prompt(prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]])
        if "prompt" in prompt:
            return encode_prompt(tokenizer, prompt["prompt"], add_special_tokens=add_special_tokens)
        raise TypeError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return Prompt(None, [int(t) for t in prompt])
    raise TypeError(f"a prompt must be a string, a dict or a list of token ids, got {prompt!r:.80}")


def truncated(prompt: Prompt, params, max_model_len: int) -> Prompt:
    """``prompt`` cut to its last ``params.truncate_prompt_tokens`` tokens (vLLM's left
    truncation; see :meth:`~dcpgraph.runtime.sampling_params.SamplingParams.truncate`); a cut
    prompt's text no longer matches its tokens, so it is dropped."""
    ids = params.truncate(prompt.token_ids, max_model_len)
    return prompt if ids is prompt.token_ids else Prompt(None, ids)


def chat_prompt(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                chat_template: str | None = None, **template_kwargs) -> Prompt:
    """The conversation rendered by the tokenizer's chat template (or ``chat_template``, a Jinja
    string), then encoded without adding special tokens again (the template writes them).
    ``template_kwargs`` go to ``apply_chat_template`` (``continue_final_message``, and the
    template's own variables such as Qwen3's ``enable_thinking``: vLLM's ``chat_template_kwargs``)."""
    if getattr(tokenizer, "chat_template", None) is None and chat_template is None:
        raise ValueError("the tokenizer has no chat template; pass chat_template= (the server: --chat-template)")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template, **template_kwargs)
    return Prompt(text, list(tokenizer.encode(text, add_special_tokens=False)))
