"""Independent references and drivers for end-to-end checks of an engine."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

REFERENCE_EXPERTS = "eager"
"""The experts implementation HF references run: transformers' plain loop over the experts hit,
which has a kernel for every dtype (``grouped_mm`` has none for fp64) and shares no code with the
``batched_mm`` form dcpgraph traces."""


@contextlib.contextmanager
def hf_reference(model: torch.nn.Module):
    """``model`` as an independent reference inside the block: its MoE experts run
    :data:`REFERENCE_EXPERTS`; the implementation it was loaded with is restored on exit, so the
    model a test hands to dcpgraph keeps transformers' defaults."""
    current = getattr(model.config, "_experts_implementation", None)
    switch = current is not None and current != REFERENCE_EXPERTS
    if switch:
        model.set_experts_implementation(REFERENCE_EXPERTS)
    try:
        yield model
    finally:
        if switch:
            model.set_experts_implementation(current)


def hf_greedy(model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """The new tokens HF transformers' own ``generate`` produces greedily for one prompt (no
    padding, so no batching effects; stops at the model's EOS like the engine does), with the
    experts of :func:`hf_reference`."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad(), hf_reference(model):
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


def record_logits(engine) -> list[torch.Tensor]:
    """Every step's logits rows ``[R, V]`` of ``engine``, appended as it runs (wraps its executor)."""
    rows: list[torch.Tensor] = []
    run = engine.executor.run

    def recording(*args, **kwargs):
        out = run(*args, **kwargs)
        rows.append(out.detach().clone())
        return out

    engine.executor.run = recording
    return rows


def teacher_forced_logits(engine, tokens: Sequence[int]) -> torch.Tensor:
    """``[len(tokens), V]``: row ``i`` is the engine's logits after reading ``tokens[: i + 1]``
    (next-token prediction at every position). The engine must be compiled with
    ``max_num_batched_tokens=1``, so that each prompt token is its own chunk and step, and be idle."""
    if engine.scheduler.has_work():
        raise ValueError("teacher_forced_logits needs an idle engine")
    shadowed = "run" in vars(engine.executor)
    original = engine.executor.run
    steps = record_logits(engine)
    try:
        engine.add_request(list(tokens), max_new_tokens=1)
        drain(engine, max_steps=len(tokens) + 1)
    finally:
        if shadowed:
            engine.executor.run = original
        else:
            del engine.executor.run
    if len(steps) != len(tokens):
        raise ValueError(f"{len(steps)} steps for {len(tokens)} tokens: compile with max_num_batched_tokens=1")
    return torch.stack([s[0] for s in steps])
