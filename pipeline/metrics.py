"""The one metric spec (docs/design.md), shared by training, offline evaluation and serving.

A verify step proposes K drafts; `accepted` is how many leading drafts the verifier kept (0..K).
Pooled tau = 1 + sum(accepted) / steps (vLLM's definition: the bonus token counts).
Per-request tau = mean over requests of each request's tau. Conditional alpha_k = P(draft k accepted | drafts
1..k-1 accepted); cumulative a_k = P(drafts 1..k accepted). Functions return raw counts where they can, so
callers reduce across ranks or requests before dividing.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceCounts:
    """Raw counts over verify steps; add them up across requests/ranks, then derive rates."""

    num_speculative_tokens: int
    steps: int = 0
    accepted_tokens: int = 0
    proposed_tokens: int = 0  # drafts sent to the verifier (fewer than K when DSpark truncates)
    # reached[k] = steps whose draft k+1 was proposed and drafts 1..k were accepted; accepted_at[k] = ... and k+1 too.
    reached: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reached = self.reached or [0] * self.num_speculative_tokens
        self.accepted_at = self.accepted_at or [0] * self.num_speculative_tokens

    def add_step(self, accepted: int, proposed: int | None = None) -> None:
        proposed = self.num_speculative_tokens if proposed is None else proposed
        if not 0 <= accepted <= proposed <= self.num_speculative_tokens:
            raise ValueError(f"accepted={accepted}, proposed={proposed} with K={self.num_speculative_tokens}")
        self.steps += 1
        self.accepted_tokens += accepted
        self.proposed_tokens += proposed
        for k in range(min(accepted + 1, proposed)):
            self.reached[k] += 1
        for k in range(accepted):
            self.accepted_at[k] += 1

    def merge(self, other: "AcceptanceCounts") -> "AcceptanceCounts":
        merged = AcceptanceCounts(self.num_speculative_tokens, self.steps + other.steps,
                                  self.accepted_tokens + other.accepted_tokens,
                                  self.proposed_tokens + other.proposed_tokens)
        merged.reached = [a + b for a, b in zip(self.reached, other.reached)]
        merged.accepted_at = [a + b for a, b in zip(self.accepted_at, other.accepted_at)]
        return merged

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted_tokens / self.steps if self.steps else 0.0

    @property
    def conditional_acceptance(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached)]

    @property
    def cumulative_acceptance(self) -> list[float]:
        return [a / self.steps if self.steps else 0.0 for a in self.accepted_at]


def merged(per_request: list[AcceptanceCounts]) -> AcceptanceCounts:
    """All requests' counts as one (the pooled figures)."""
    total = per_request[0]
    for counts in per_request[1:]:
        total = total.merge(counts)
    return total


def pooled_tau(per_request: list[AcceptanceCounts]) -> float:
    return merged(per_request).tau


def per_request_tau(per_request: list[AcceptanceCounts]) -> float:
    taus = [c.tau for c in per_request if c.steps]
    return sum(taus) / len(taus) if taus else 0.0


def expected_tau(conditional: list[float]) -> float:
    """Expected tau from conditional acceptance rates: 1 + sum_k prod_{j<=k} alpha_j."""
    tau, survive = 1.0, 1.0
    for alpha in conditional:
        survive *= alpha
        tau += survive
    return tau


def served_figures(counters: dict) -> dict:
    """The spec's figures from vLLM's spec-decode counters (num_drafts, num_draft_tokens, num_accepted_tokens,
    num_accepted_tokens_per_pos [K]): pooled tau and cumulative acceptance per position [K]. Read alike by the
    evaluation's vLLM cross-check, Ray Serve's served.* metrics and the benchmarks. Raises PipelineError when vLLM
    counted no draft step."""
    from pipeline.errors import PipelineError

    drafts = counters["num_drafts"]
    if drafts == 0:
        raise PipelineError("vllm_eval: vLLM reported no draft steps (speculation did not run)")
    return {"tau": 1.0 + counters["num_accepted_tokens"] / drafts,
            "cumulative_acceptance": [n / drafts for n in counters["num_accepted_tokens_per_pos"]],
            "num_drafts": drafts, "num_draft_tokens": counters["num_draft_tokens"],
            "num_accepted_tokens": counters["num_accepted_tokens"]}
