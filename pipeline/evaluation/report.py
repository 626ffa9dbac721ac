"""Evaluation report files: report.json, a per-position acceptance plot (PNG) and a markdown table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from pipeline.fsutil import atomic_write_text


class _Figures(BaseModel):
    """Figures as JSON kinds, strictly (true is no number, "1.5" no number); fields nobody reads back pass."""
    model_config = ConfigDict(strict=True, extra="allow")


class SetFigures(_Figures):
    """One eval set's acceptance, as the report's `datasets.<set>` holds it (and the whole report at its top)."""
    num_requests: int
    verify_steps: int
    pooled_tau: float
    per_request_tau: float
    conditional_acceptance: list[float]
    cumulative_acceptance: list[float]


class ProfileRow(_Figures):
    k: int
    tau: float
    draft_ms_per_step: float
    verify_ms_per_step: float
    predicted_speedup: float
    measured_speedup: float


class Profile(_Figures):
    num_prompts: int
    plain_ms_per_token: float
    recommended_k: int = Field(ge=1)
    per_k: list[ProfileRow]
    max_new_tokens: Optional[int] = None


class ReportFigures(SetFigures):
    """What the later stages read back from a finished report.json (export's card, vllm_eval, promote's gate, the
    MLflow metrics of a reused report): a hand-edited or damaged one is refused by pipeline.errors.read_json_object
    before it can fail in the middle of a stage."""
    drafts_per_step: float
    num_speculative_tokens: int = Field(ge=1)
    max_new_tokens: int
    temperature: float
    greedy_mismatches: list
    datasets: dict[str, SetFigures]
    profile: Optional[Profile]
    drafter: str
    verifier: str
    checkpoint: str
    signature: str


def _set_rows(report: dict) -> list[str]:
    lines = ["| eval set | requests | pooled τ | per-request τ | α_1 | verify steps |", "|---|---|---|---|---|---|"]
    for name, result in {**report.get("datasets", {}), "all": report}.items():
        alpha = result["conditional_acceptance"][0] if result["conditional_acceptance"] else 0.0
        lines.append(f"| {name} | {result['num_requests']} | {result['pooled_tau']:.3f} | "
                     f"{result['per_request_tau']:.3f} | {alpha:.3f} | {result['verify_steps']} |")
    return lines


def _profile_rows(profile: dict) -> list[str]:
    tokens = f" of {profile['max_new_tokens']} new tokens" if profile.get("max_new_tokens") else ""
    lines = [f"Speculation profile ({profile['num_prompts']} prompts{tokens} one at a time; plain decoding "
             f"{profile['plain_ms_per_token']:.1f} ms/token). Recommended K = **{profile['recommended_k']}**.", "",
             "| K | τ | draft ms/step | verify ms/step | predicted speedup | measured speedup |",
             "|---|---|---|---|---|---|"]
    for row in profile["per_k"]:
        lines.append(f"| {row['k']} | {row['tau']:.3f} | {row['draft_ms_per_step']:.1f} | "
                     f"{row['verify_ms_per_step']:.1f} | {row['predicted_speedup']:.2f} | "
                     f"{row['measured_speedup']:.2f} |")
    return lines


def markdown_table(report: dict) -> str:
    lines = [
        f"# {report.get('drafter', '?')} on {report.get('verifier', '?')} ({report.get('dataset', '?')})",
        "",
        f"pooled tau **{report['pooled_tau']:.3f}**, per-request tau {report['per_request_tau']:.3f}, "
        f"K = {report['num_speculative_tokens']}, temperature {report.get('temperature', 0.0)}, "
        f"{report['num_requests']} requests, {report['verify_steps']} steps",
        "",
        *_set_rows(report),
        "",
        "| position | conditional acceptance | cumulative acceptance |",
        "|---|---|---|",
    ]
    for k, (cond, cum) in enumerate(zip(report["conditional_acceptance"], report["cumulative_acceptance"]), 1):
        lines.append(f"| {k} | {cond:.3f} | {cum:.3f} |")
    if report.get("profile"):
        lines += ["", *_profile_rows(report["profile"])]
    return "\n".join(lines) + "\n"


def plot_acceptance(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profile = report.get("profile")
    figure, axes = plt.subplots(1, 2 if profile else 1, figsize=(10 if profile else 5, 3.4), dpi=120,
                                squeeze=False)
    axis = axes[0][0]
    positions = list(range(1, len(report["conditional_acceptance"]) + 1))
    for name, result in {"all (cumulative)": None, **report.get("datasets", {})}.items():
        if result is None:
            axis.plot(positions, report["cumulative_acceptance"], marker="s", color="black",
                      label="all: cumulative a_k")
            axis.plot(positions, report["conditional_acceptance"], marker="o", color="black", linestyle="--",
                      label="all: conditional α_k")
        elif len(report.get("datasets", {})) > 1:
            axis.plot(positions, result["conditional_acceptance"], marker=".", label=f"{name}: α_k")
    axis.set_xlabel("draft position k")
    axis.set_ylabel("acceptance")
    axis.set_ylim(0, 1)
    axis.set_xticks(positions)
    axis.set_title(f"{report.get('drafter', '')}: pooled τ = {report['pooled_tau']:.2f}")
    axis.legend(fontsize=7)
    if profile:
        ks = [row["k"] for row in profile["per_k"]]
        right = axes[0][1]
        right.plot(ks, [row["predicted_speedup"] for row in profile["per_k"]], marker="o", label="predicted speedup")
        right.plot(ks, [row["tau"] for row in profile["per_k"]], marker="s", label="τ")
        right.axvline(profile["recommended_k"], color="grey", linestyle=":", label="recommended K")
        right.set_xlabel("K (drafts per step)")
        right.set_xticks(ks)
        right.set_title("speculation profile")
        right.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def write_report(report: dict, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / "report.md", markdown_table(report))
    partial = folder / ".acceptance.png.partial.png"
    plot_acceptance(report, partial)
    partial.replace(folder / "acceptance.png")
    atomic_write_text(folder / "report.json", json.dumps(report, indent=1))  # last: its presence means complete
