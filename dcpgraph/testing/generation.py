"""Independent references and drivers for end-to-end checks of an engine."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def hf_greedy(model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """The new tokens HF transformers' own ``generate`` produces greedily for one prompt (no
    padding, so no batching effects; stops at the model's EOS like the engine does)."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def drain(engine, outputs: dict[int, list[int]] | None = None, max_steps: int = 500) -> dict[int, list[int]]:
    """Step ``engine`` until nothing is queued or running, collecting each request's tokens."""
    outputs = {} if outputs is None else outputs
    for _ in range(max_steps):
        if not engine.scheduler.has_work():
            return outputs
        for rid, token, _ in engine.step():
            outputs.setdefault(rid, []).append(token)
    raise AssertionError(f"engine did not finish within {max_steps} steps")
