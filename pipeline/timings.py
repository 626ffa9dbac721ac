"""How long each stage of a job took: a table for the end of the job and metrics for its parent MLflow run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

TOTAL_METRIC = "time.total_s"


def stage_metric(stage: str) -> str:
    """The parent-run metric holding a stage's seconds, e.g. 'time.train_s'; raises nothing."""
    return f"time.{stage}_s"


@dataclass(frozen=True)
class StageTime:
    """One stage's wall-clock seconds, and whether it failed."""

    stage: str
    seconds: float
    failed: bool = False


@dataclass
class StageTimes:
    """The stages of one job in the order they ran; the total is their sum, so the shares add up to 100%."""

    entries: list[StageTime] = field(default_factory=list)

    def add(self, stage: str, seconds: float, failed: bool = False) -> float:
        """Record a stage that ended (or failed). Returns its seconds; raises nothing."""
        self.entries.append(StageTime(stage, seconds, failed))
        return seconds

    @property
    def total(self) -> float:
        """The sum of the stages' seconds (0.0 before any stage ended)."""
        return sum(entry.seconds for entry in self.entries)

    @property
    def failed_stage(self) -> Optional[str]:
        """The stage that failed, or None when none did."""
        return next((entry.stage for entry in self.entries if entry.failed), None)

    def table(self, job: str) -> str:
        """The compact table printed at the end of a job: a title naming the job (and the failed stage), then one
        row per stage (seconds, share of the total) and the total. Returns the text without a final newline;
        raises nothing (an empty job gives a table with only its total)."""
        width = max([len("stage"), len("total")] + [len(entry.stage) for entry in self.entries])
        failed = self.failed_stage
        lines = [f"{job}: stage times" + (f" ({failed} failed)" if failed else ""),
                 f"{'stage':<{width}}  {'seconds':>8}  {'share':>6}"]
        lines += [self._row(entry.stage, entry.seconds, width) + ("  failed" if entry.failed else "")
                  for entry in self.entries]
        lines.append(self._row("total", self.total, width))
        return "\n".join(lines)

    def _row(self, name: str, seconds: float, width: int) -> str:
        share = seconds / self.total if self.total > 0 else 0.0
        return f"{name:<{width}}  {seconds:>8.1f}  {share:>6.1%}"
