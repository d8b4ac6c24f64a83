"""Each PCP rank attends its share of the step: the (query, head, key) triples the paged reads of
a prefill visit, summed over all ranks, equal causal attention's on one rank,
``layers · heads · n(n+1)/2`` for an ``n``-token prompt, so each of the ``tp · pcp`` ranks does
``1 / (tp · pcp)`` of the attention whatever the DCP group spans (its own rows at dcp = 1, its
group's rows at 1 < dcp < pcp, distinct head blocks when dcp > pcp). Before the group rows and
the distinct head blocks, (1, 4, 2) and (2, 2, 4) visited twice that."""

from __future__ import annotations

import pytest
import torch
from pcp_models import pcp_model

import dcpgraph
from dcpgraph.ops import paged
from dcpgraph.pcp.step_rows import pcp_group_rows, pcp_step_rows


class AttentionWork:
    """Counts the (query, head, key) triples each paged read visits: per query of row ``r``,
    ``min(kv_lens[r], kv_bound[t])`` keys for each of its heads (wraps the op's kernel)."""

    def __init__(self, kernel):
        self.kernel, self.triples = kernel, 0

    def __call__(self, q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, kv_bound, *rest):
        cu, lens = cu_seqlens_q.tolist(), kv_lens.tolist()
        bounds = None if kv_bound is None else kv_bound.tolist()
        for r in range(len(cu) - 1):
            for t in range(cu[r], cu[r + 1]):
                self.triples += q.shape[1] * (lens[r] if bounds is None else min(lens[r], bounds[t]))
        return self.kernel(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, kv_bound, *rest)


def _prefill_work(monkeypatch, model, prompt, **mesh) -> int:
    engine = dcpgraph.compile(model, max_num_batched_tokens=64, backend="eager", **mesh)
    work = AttentionWork(paged.paged_partial_attention)
    with monkeypatch.context() as patch:
        patch.setattr(paged, "paged_partial_attention", work)
        engine.generate([prompt], 1)
    return work.triples


@pytest.mark.parametrize("tp, pcp, dcp", [(1, 4, 2), (2, 2, 4), (1, 2, 1)])
def test_ranks_split_the_attention_work_of_one_rank(monkeypatch, tp, pcp, dcp):
    model = pcp_model("llama")
    n, config = 40, model.config
    prompt = torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(3)).tolist()
    one_rank = config.num_hidden_layers * config.num_attention_heads * n * (n + 1) // 2
    visited = _prefill_work(monkeypatch, model, prompt, tp=tp, pcp=pcp, dcp=dcp)
    assert visited == one_rank, f"the {tp * pcp} ranks visit {visited / one_rank:.2f}× one rank's attention"


@pytest.mark.parametrize("counts", [[5, 3, 1], [1], [9, 1, 1, 6]])
def test_group_rows_hold_each_members_rows_by_request(counts):
    rows, _, _ = pcp_step_rows(counts, 4)
    group_rows, group_cu, own = pcp_group_rows(rows, counts, 2)
    starts = [sum(counts[:r]) for r in range(len(counts) + 1)]
    for p in range(4):
        first = p // 2 * 2
        assert torch.equal(group_rows[p], group_rows[first]) and torch.equal(group_cu[p], group_cu[first])
        assert torch.equal(group_rows[p][own[p]], rows[p])  # every own row found among the group's
        assert sorted(group_rows[p].tolist()) == sorted(rows[first].tolist() + rows[first + 1].tolist())
        cu = group_cu[p].tolist()
        for r in range(len(counts)):  # request r's rows are contiguous (padding copies of row 0 are request 0's)
            assert all(starts[r] <= x < starts[r + 1] for x in group_rows[p][cu[r]:cu[r + 1]].tolist())
