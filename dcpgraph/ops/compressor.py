"""The compressor of DeepSeek-V4's compressed attention, as a stream over one request's tokens.

Every ``m`` (the rate) source tokens close a window and emit one compressed entry. With ``C_j``
and ``Z_j`` the token's projected values and gates and ``B`` the learned per-slot position bias
(``[m, ·]``), entry ``w`` is the gated pooling (before the model's norm and rotary)::

    non-overlapping (HCA):  e_w = Σ_{j<m} softmax_j(Z_{wm+j} + B_j) ⊙ C_{wm+j}
    overlapping (CSA):      the projections are 2D wide, C = [Ca | Cb]; entry w pools the 2m slots
                            [Ca of window w−1 | Cb of window w] with one softmax over the slots;
                            for w = 0 the Ca half is absent (weight 0)

The softmax runs in fp32 and is cast back to the values' dtype, as transformers does. Entry ``w``
depends only on source tokens ``[(w−1)m, (w+1)m)``, so the stream gives the same entries however
the tokens are cut into steps (chunked prefill, decode). What a request must keep between steps is
its :class:`OpenWindow`: fewer than ``m`` source tokens since the last emitted entry and, when
overlapping, the last closed window's Ca half — per-request state of at most ``2m`` rows,
independent of the sequence length and of DCP (every rank of a group holds the same copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OpenWindow:
    """One request's compressor state: ``kv``/``gate`` ``[n < m, width]`` source rows not yet in an
    entry (gates without the position bias); ``carry_kv``/``carry_gate`` ``[m, width / 2]``, the
    last closed window's Ca half with its position bias added (overlapping only, ``None`` before
    the first window closes); ``entries``: entries emitted so far."""

    kv: torch.Tensor
    gate: torch.Tensor
    carry_kv: torch.Tensor | None = None
    carry_gate: torch.Tensor | None = None
    entries: int = 0


def open_window(width: int, *, dtype: torch.dtype, device=None) -> OpenWindow:
    """The state of a request that has no token yet."""
    empty = torch.empty(0, width, dtype=dtype, device=device)
    return OpenWindow(kv=empty, gate=empty)


def compress_stream(state: OpenWindow, kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor,
                    *, rate: int, overlap: bool) -> tuple[torch.Tensor, OpenWindow]:
    """Feed the next source rows ``kv``/``gate`` ``[n, width]`` → ``(entries [E, D], state)``: the
    pooled entries the rows close (``E`` may be 0; entry ``i`` is global entry
    ``state.entries + i``) and the state after them. ``D = width`` (non-overlapping) or
    ``width / 2`` (overlapping)."""
    if rate < 1:
        raise ValueError(f"compressor rate must be a positive int, got {rate!r}")
    width = kv.shape[-1]
    if overlap and width % 2:
        raise ValueError(f"an overlapping compressor projects to 2·head_dim features; got width {width}")
    rows_kv = torch.cat([state.kv, kv], dim=0)
    rows_gate = torch.cat([state.gate, gate], dim=0)
    windows = rows_kv.shape[0] // rate
    usable = windows * rate
    rest_kv, rest_gate = rows_kv[usable:], rows_gate[usable:]
    if windows == 0:
        out_dim = width // 2 if overlap else width
        kept = OpenWindow(rest_kv, rest_gate, state.carry_kv, state.carry_gate, state.entries)
        return rows_kv.new_empty(0, out_dim), kept
    chunk_kv = rows_kv[:usable].reshape(windows, rate, width)
    chunk_gate = rows_gate[:usable].reshape(windows, rate, width) + position_bias
    if not overlap:
        weights = chunk_gate.softmax(dim=1, dtype=torch.float32).to(chunk_kv.dtype)
        pooled = (chunk_kv * weights).sum(dim=1)
        return pooled, OpenWindow(rest_kv, rest_gate, None, None, state.entries + windows)
    half = width // 2
    slots_kv = chunk_kv.new_zeros(windows, 2 * rate, half)
    slots_gate = chunk_gate.new_full((windows, 2 * rate, half), float("-inf"))
    slots_kv[:, rate:] = chunk_kv[..., half:]
    slots_gate[:, rate:] = chunk_gate[..., half:]
    slots_kv[1:, :rate] = chunk_kv[:-1, :, :half]
    slots_gate[1:, :rate] = chunk_gate[:-1, :, :half]
    if state.carry_kv is not None:
        slots_kv[0, :rate] = state.carry_kv.to(slots_kv.dtype)
        slots_gate[0, :rate] = state.carry_gate.to(slots_gate.dtype)
    weights = slots_gate.softmax(dim=1, dtype=torch.float32).to(slots_kv.dtype)
    pooled = (slots_kv * weights).sum(dim=1)
    carry_kv, carry_gate = chunk_kv[-1, :, :half].clone(), chunk_gate[-1, :, :half].clone()
    return pooled, OpenWindow(rest_kv, rest_gate, carry_kv, carry_gate, state.entries + windows)


def visible_entries(positions: torch.Tensor, rate: int) -> torch.Tensor:
    """How many entries a query at global position ``p`` may read: ``(p + 1) // m`` (entry ``w``
    summarises tokens up to ``(w + 1)m − 1``, so it is visible once they all are)."""
    return torch.div(positions + 1, rate, rounding_mode="floor")
