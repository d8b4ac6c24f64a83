"""The two DSA ``npu::`` ops for the torchair tier: declared from the torch-npu wheel's own schema
lines (so they match libtorch_npu's exactly), with fake kernels, and opt-in CPU references.

Worker side only (like :func:`torchair_support.activate`): declaring ``npu::`` ops is process-wide.
The CPU references follow the ops' documentation for the forms dcpgraph emits (TND queries, paged
``PA_BSND`` keys with a block table, ``sparse_mode=0``): LightningIndexer scores
``Σ_h w_h·relu(q_h·k)`` (no scale) and keeps the top ``sparse_count`` (score desc, then position;
the real op's tie order is not documented), −1 padded; SparseFlashAttention attends over the listed
keys (``scale·(q·k + q_rope·k_rope)``) and returns the softmax max and sum ``[1, T, N]``. A token
with no listed key gets a deliberately bad result (out NaN, max 0, sum 0): what the op returns there
is not documented, so the lowering must mask it. They check dcpgraph's side of the lowering only.
"""

from __future__ import annotations

import re
import zipfile

from torchair_support import _LIBS, _YAML, CACHE_DIR, TORCH_NPU_VERSION

OPS = ("npu_lightning_indexer", "npu_sparse_flash_attention")


def _schemas() -> dict[str, str]:
    wheel = sorted(CACHE_DIR.glob(f"torch_npu-{TORCH_NPU_VERSION}-*.whl"))[0]
    found = {}
    with zipfile.ZipFile(wheel) as z:
        for line in z.read(_YAML).decode().splitlines():
            m = re.match(r"\s*-?\s*func:\s*((\w+)\(.*)$", line)
            if m and m.group(2) in OPS:
                found.setdefault(m.group(2), m.group(1))
    missing = [op for op in OPS if op not in found]
    if missing:
        raise RuntimeError(f"schemas of {missing} not found in the wheel's {_YAML}")
    return found


def declare() -> None:
    import torch

    if hasattr(torch.ops, "npu") and all(hasattr(torch.ops.npu, op) for op in OPS):
        return
    schemas = _schemas()
    lib = torch.library.Library("npu", "FRAGMENT")  # noqa: TOR901 - stands in for libtorch_npu
    _LIBS.append(lib)
    for op in OPS:
        lib.define(schemas[op])

    def indexer_fake(query, key, weights, *, sparse_count=2048, return_value=False, **_):
        shape = (query.shape[0], key.shape[2], sparse_count)
        return query.new_empty(shape, dtype=torch.int32), query.new_empty(shape if return_value else (0,))

    def sfa_fake(query, key, value, sparse_indices, scale_value, *, return_softmax_lse=False, **_):
        t, n = query.shape[0], query.shape[1]
        stats = (key.shape[2], t, n // key.shape[2]) if return_softmax_lse else (0,)
        return (query.new_empty((t, n, value.shape[-1])), query.new_empty(stats, dtype=torch.float32),
                query.new_empty(stats, dtype=torch.float32))

    torch.library.register_fake("npu::npu_lightning_indexer", indexer_fake, lib=lib)
    torch.library.register_fake("npu::npu_sparse_flash_attention", sfa_fake, lib=lib)


GE_IRS = ("LightningIndexer", "SparseFlashAttention")


def register_ge_irs() -> None:
    """Report the two GE IRs as registered in torchair's stand-in C extension (worker side, after
    :func:`torchair_support.activate`). On Ascend, CANN's op packages register them; their
    converters pass inputs and attributes by name, so the status is all they read."""
    import sys

    core = sys.modules["torchair.core._torchair"]
    previous = core.get_registered_ir_def

    def get_registered_ir_def(name):
        return ("SUCCESS", [], [], []) if name in GE_IRS else previous(name)

    core.get_registered_ir_def = get_registered_ir_def


def register_cpu_references() -> None:
    import torch

    lib = torch.library.Library("npu", "FRAGMENT")  # noqa: TOR901
    _LIBS.append(lib)
    lib.impl("npu_lightning_indexer", _indexer_cpu, "CPU")
    lib.impl("npu_sparse_flash_attention", _sfa_cpu, "CPU")


def _rows(ends):
    start = 0
    for r, end in enumerate(int(x) for x in ends.tolist()):
        yield r, start, end
        start = end


def _gather(cache, table_row, length):
    block = cache.shape[1]
    blocks = table_row[: -(-length // block)].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:length]  # [L, 1, D]


def _indexer_cpu(query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                 block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048, sparse_mode=3,
                 return_value=False, **_):
    import torch

    if (layout_query, layout_key, sparse_mode) != ("TND", "PA_BSND", 0):
        raise NotImplementedError(f"CPU reference of LightningIndexer: {layout_query}/{layout_key}/{sparse_mode}")
    t = query.shape[0]
    indices = torch.full((t, 1, sparse_count), -1, dtype=torch.int32)
    values = torch.full((t, 1, sparse_count), float("-inf"), dtype=query.dtype)
    for r, start, end in _rows(actual_seq_lengths_query):
        length = int(actual_seq_lengths_key[r])
        if length <= 0 or end <= start:
            continue
        k = _gather(key, block_table[r], length)[:, 0].float()  # [L, D]
        scores = (weights[start:end].float().unsqueeze(-1)
                  * torch.relu(query[start:end].float() @ k.T)).sum(1)  # [n, L]
        for i in range(end - start):
            row = [float(x) for x in scores[i]]
            chosen = sorted(range(length), key=lambda j, row=row: (-row[j], j))[:sparse_count]
            indices[start + i, 0, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
            values[start + i, 0, : len(chosen)] = scores[i, chosen].to(query.dtype)
    return indices, values if return_value else values.new_empty((0,))


def _sfa_cpu(query, key, value, sparse_indices, scale_value, *, block_table=None, actual_seq_lengths_query=None,
             actual_seq_lengths_kv=None, query_rope=None, key_rope=None, layout_query="BSND", layout_kv="BSND",
             sparse_mode=3, return_softmax_lse=False, **_):
    import torch

    if (layout_query, layout_kv, sparse_mode) != ("TND", "PA_BSND", 0):
        raise NotImplementedError(f"CPU reference of SparseFlashAttention: {layout_query}/{layout_kv}/{sparse_mode}")
    t, n, _ = query.shape
    out = torch.full((t, n, value.shape[-1]), float("nan"), dtype=query.dtype)
    peak = torch.zeros(1, t, n, dtype=torch.float32)
    total = torch.zeros(1, t, n, dtype=torch.float32)
    for r, start, end in _rows(actual_seq_lengths_query):
        length = int(actual_seq_lengths_kv[r])
        for i in range(start, end):
            chosen = [j for j in sparse_indices[i, 0].tolist() if 0 <= j < length]
            if not chosen:
                continue
            k = _gather(key, block_table[r], length)[chosen, 0].double()
            v = _gather(value, block_table[r], length)[chosen, 0].double()
            kr = _gather(key_rope, block_table[r], length)[chosen, 0].double()
            s = scale_value * (query[i].double() @ k.T + query_rope[i].double() @ kr.T)  # [N, k]
            m = s.max(-1).values
            e = torch.exp(s - m.unsqueeze(-1))
            out[i] = ((e @ v) / e.sum(-1, keepdim=True)).to(query.dtype)
            peak[0, i], total[0, i] = m.float(), e.sum(-1).float()
    if not return_softmax_lse:
        return out, peak.new_empty((0,)), total.new_empty((0,))
    return out, peak, total
