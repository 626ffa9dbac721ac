"""Evaluation report files: report.json, a per-position acceptance plot (PNG) and a markdown table."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.fsutil import atomic_write_text


def markdown_table(report: dict) -> str:
    lines = [
        f"# {report.get('drafter', '?')} on {report.get('verifier', '?')} ({report.get('dataset', '?')})",
        "",
        f"pooled tau **{report['pooled_tau']:.3f}**, per-request tau {report['per_request_tau']:.3f}, "
        f"K = {report['num_speculative_tokens']}, {report['num_requests']} requests, {report['verify_steps']} steps",
        "",
        "| position | conditional acceptance | cumulative acceptance |",
        "|---|---|---|",
    ]
    for k, (cond, cum) in enumerate(zip(report["conditional_acceptance"], report["cumulative_acceptance"]), 1):
        lines.append(f"| {k} | {cond:.3f} | {cum:.3f} |")
    return "\n".join(lines) + "\n"


def plot_acceptance(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    positions = list(range(1, len(report["conditional_acceptance"]) + 1))
    figure, axis = plt.subplots(figsize=(5, 3.2), dpi=120)
    axis.plot(positions, report["conditional_acceptance"], marker="o", label="conditional α_k")
    axis.plot(positions, report["cumulative_acceptance"], marker="s", label="cumulative a_k")
    axis.set_xlabel("draft position k")
    axis.set_ylabel("acceptance")
    axis.set_ylim(0, 1)
    axis.set_xticks(positions)
    axis.set_title(f"{report.get('drafter', '')}: pooled τ = {report['pooled_tau']:.2f}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def write_report(report: dict, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / "report.json", json.dumps(report, indent=1))
    atomic_write_text(folder / "report.md", markdown_table(report))
    plot_acceptance(report, folder / "acceptance.png")
