"""Acceptance statistics of speculative decoding.

Per verified row (a chunk that carried ``d >= 1`` drafts of which the first ``a`` were accepted):
``drafted += d``, ``accepted += a``, ``drafted_per_position[j] += 1`` for ``j < d`` and
``accepted_per_position[j] += 1`` for ``j < a``. Derived: ``acceptance_rate = accepted / drafted``,
``acceptance_rate_per_position[j] = accepted_per_position[j] / drafted_per_position[j]`` and
``mean_accepted_length = 1 + accepted / verified_rows`` (tokens emitted per verified row, vLLM's
"mean acceptance length": the target's own token counts as one).
"""

from __future__ import annotations


class AcceptanceStats:
    def __init__(self, k: int):
        self.k = k
        self.verified_rows = 0
        self.drafted = 0
        self.accepted = 0
        self.drafted_per_position = [0] * k
        self.accepted_per_position = [0] * k

    def record(self, drafted: int, accepted: int) -> None:
        if not 0 <= accepted <= drafted <= self.k:
            raise ValueError(f"accepted={accepted}, drafted={drafted} with k={self.k}")
        self.verified_rows += 1
        self.drafted += drafted
        self.accepted += accepted
        for j in range(drafted):
            self.drafted_per_position[j] += 1
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    def report(self) -> dict:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "verified_rows": self.verified_rows,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate_per_position": [a / d if d else None for a, d in
                                             zip(self.accepted_per_position, self.drafted_per_position)],
            "mean_accepted_length": 1 + self.accepted / self.verified_rows if self.verified_rows else None,
        }
