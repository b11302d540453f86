"""Speculation counters for one request (and, summed, for the server)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_steps: int = 0  # target forwards after prefill
    num_spec_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_emitted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    k_histogram: dict[int, int] = field(default_factory=dict)

    def observe_step(self, k: int, accepted: int, emitted: int) -> None:
        self.num_steps += 1
        self.num_emitted += emitted
        self.k_histogram[k] = self.k_histogram.get(k, 0) + 1
        if k == 0:
            return
        self.num_spec_steps += 1
        self.num_drafted += k
        self.num_accepted += accepted
        grow = [0] * (k - len(self.drafted_per_position))  # positions drafted for the first time
        self.drafted_per_position += grow
        self.accepted_per_position += grow
        for i in range(k):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.num_emitted / self.num_steps if self.num_steps else 0.0

    def as_dict(self) -> dict:
        by_position = [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]
        return {
            "target_forwards": self.num_steps,
            "speculative_steps": self.num_spec_steps,
            "drafted": self.num_drafted,
            "accepted": self.num_accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_by_position": [round(a, 4) for a in by_position],
            "tokens_per_forward": round(self.tokens_per_forward, 4),
            "mean_k": round(self.num_drafted / max(self.num_steps, 1), 3),
            # drafts per step that drafted at all (a suffix proposer's length follows its match)
            "mean_draft_length": round(self.num_drafted / max(self.num_spec_steps, 1), 3),
            "k_histogram": {str(k): v for k, v in sorted(self.k_histogram.items())},
        }
