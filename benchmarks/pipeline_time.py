"""The default pipeline's wall time, stage by stage, before and after a change, written as JSON.

    python benchmarks/pipeline_time.py --before <git ref> [--out benchmarks/results/pipeline_time.json] [overrides]
    python benchmarks/pipeline_time.py --before-root DIR --after-root DIR      # two finished runs' output roots

Runs `python jobs/run_pipeline.py` (the README's first command) for the `--before` commit (checked out in a temporary
git worktree, its own code on PYTHONPATH) and then for this working tree, one right after the other, each on a cold
output root; the verifier's conversion is cached under ~/.cache/pipeline for both. Stage times come from the same
place for both sides: the start and end of each stage's MLflow child run, and the job's from its parent run. Also
recorded: the machine (CPU model, AVX2 / AVX512-BF16, cores), the held-out pooled tau at the evaluated K, the
greedy-equivalence result, the vLLM tau gap and whether the gate promoted, so speed is never bought with quality.
A root that is no finished run (no folder, no MLflow store or one MLflow cannot read, no evaluation report or a
damaged one), a --before that names no commit, overrides that do not compose and validate, or an --out that is a
folder, is one line naming the flag, before anything is created.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.errors import PipelineError, first_line, read_json, require  # noqa: E402
from pipeline.fsutil import atomic_write_text  # noqa: E402

STAGES = ("prompts", "regenerate", "capture", "train", "evaluate", "export", "vllm_eval", "promote")


def machine() -> dict:
    flags: set[str] = set()
    model = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
    return {"cpu": model, "cores": os.cpu_count(), "avx2": "avx2" in flags,
            "avx512_bf16": "avx512_bf16" in flags, "amx": "amx_bf16" in flags}


def run_pipeline(code_dir: Path, root: Path, overrides: list[str]) -> float:
    """Wall seconds of `python jobs/run_pipeline.py` run from code_dir (its own package first on the path)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env["PYTHONPATH"] = str(code_dir)
    log = root.with_suffix(".log")
    started = time.time()
    with log.open("w") as out:
        result = subprocess.run([sys.executable, "jobs/run_pipeline.py", f"paths.root={root}", *overrides],
                                cwd=code_dir, env=env, stdout=out, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise SystemExit(f"the pipeline in {code_dir} failed (exit {result.returncode}); its log: {log}")
    return time.time() - started


def check_root(root: Path, flag: str) -> None:
    """Raises PipelineError naming `flag` unless root holds a finished run: its MLflow store and an evaluation
    report. Reads nothing into MLflow, so a wrong path creates no store."""
    require(root.is_dir(), f"{flag} {root}: no such folder (give a finished run's paths.root)")
    require((root / "mlflow" / "mlflow.db").is_file(), f"{flag} {root}: no MLflow store at mlflow/mlflow.db")
    require(any(root.glob("eval/*/report.json")), f"{flag} {root}: no evaluation report (eval/*/report.json)")


def measured(root: Path, flag: str = "--root") -> dict:
    """Stage and job seconds from the root's MLflow store, and the quality figures of its evaluation. Raises
    PipelineError naming `flag` when the root is no finished pipeline run (check_root, then its MLflow runs)."""
    check_root(root, flag)
    runs = _runs(root, flag)
    # the first job on the root is the cold one (a later rerun of the same command reuses every stage)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    require(bool(parents) and parents[0].info.end_time is not None,
            f"{flag} {root}: no finished pipeline job in its MLflow store")
    parent = parents[0]
    stages = {}
    for run in runs:
        if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id:
            stages[run.data.tags["stage"]] = (run.info.end_time - run.info.start_time) / 1000
    report = _report(next(root.glob("eval/*/report.json")), flag)
    served_files = list(root.glob("eval/*/vllm.json"))
    served = read_json(served_files[0], flag) if served_files else {}
    require(isinstance(served, dict), f"{flag} {served_files[0] if served_files else root}: not a JSON object")
    promote = [r for r in runs if r.data.tags.get("stage") == "promote"
               and r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    return {
        "job_seconds": (parent.info.end_time - parent.info.start_time) / 1000,
        "stage_seconds": {s: round(stages[s], 1) for s in STAGES if s in stages},
        "held_out_pooled_tau": report["datasets"]["held_out"]["pooled_tau"],
        "num_speculative_tokens": report["num_speculative_tokens"],
        "conditional_acceptance": report["conditional_acceptance"],
        "greedy_mismatches": len(report["greedy_mismatches"]),
        "vllm_tau": served.get("tau"), "vllm_tau_gap": served.get("tau_gap"),
        "gate": promote[0].data.tags.get("gate.decision") if promote else None,
    }


def _runs(root: Path, flag: str) -> list:
    """The runs of the root's 'speculators' experiment, oldest first; a store MLflow cannot read is one line."""
    import mlflow
    from sqlalchemy.exc import SQLAlchemyError

    try:
        client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow' / 'mlflow.db'}")
        experiment = client.get_experiment_by_name("speculators")
        require(experiment is not None, f"{flag} {root}: its MLflow store has no 'speculators' experiment")
        return client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    except (mlflow.exceptions.MlflowException, SQLAlchemyError) as error:
        raise PipelineError(f"{flag} {root}: its MLflow store mlflow/mlflow.db cannot be read "
                            f"({first_line(error)})") from None


def _report(path: Path, flag: str) -> dict:
    """The evaluation report with the fields this benchmark records; anything else is one line naming the file."""
    report = read_json(path, flag)
    try:
        report["datasets"]["held_out"]["pooled_tau"]
        report["num_speculative_tokens"], report["conditional_acceptance"], len(report["greedy_mismatches"])
    except (KeyError, TypeError):
        raise PipelineError(f"{flag} {path}: not an evaluation report (needs datasets.held_out.pooled_tau, "
                            "num_speculative_tokens, conditional_acceptance, greedy_mismatches)") from None
    return report


def check_out(out: Path) -> None:
    """--out must be a file this script can write: not a folder, and under no file."""
    from pipeline.fsutil import output_file_problem

    problem = output_file_problem(out)
    require(problem is None, problem or "")


def check_overrides(overrides: list[str]) -> None:
    """The overrides compose and validate in this tree, before either run starts (a bad one would fail the first
    run minutes in, and leave its worktree behind)."""
    from pipeline.config import compose, validate
    from pipeline.config.registration import config_error_line, is_composition_error

    try:
        validate(compose(overrides))
    except Exception as error:  # noqa: BLE001 - only Hydra's composition errors are turned into one line
        if not is_composition_error(error):
            raise
        raise PipelineError(config_error_line(error, overrides)) from None


def compare(before: dict, after: dict) -> dict:
    ratios = {s: round(after["stage_seconds"][s] / before["stage_seconds"][s], 3)
              for s in after["stage_seconds"] if before["stage_seconds"].get(s)}
    return {"after_over_before": round(after["job_seconds"] / before["job_seconds"], 3),
            "stage_after_over_before": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="git ref of the code to compare against")
    parser.add_argument("--before-root", type=Path, help="output root of a finished run of the old code")
    parser.add_argument("--after-root", type=Path, help="output root of a finished run of this tree")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "pipeline_time.json")
    parser.add_argument("--note", default="", help="free text stored with the result (conditions, noise)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs (none: the default run)")
    args = parser.parse_args()
    result = {"machine": machine(), "overrides": args.overrides, "note": args.note}
    check_out(args.out)
    if args.before and (args.before_root or args.after_root):  # either pair of runs, not a mix
        parser.error("give --before REF alone (both runs made here), or --before-root and --after-root")
    if bool(args.before_root) != bool(args.after_root):
        parser.error("--before-root and --after-root go together")
    if args.before_root and args.after_root:
        before_root, after_root = args.before_root.expanduser().resolve(), args.after_root.expanduser().resolve()
        flags = ("--before-root", "--after-root")
        check_root(before_root, flags[0])
        check_root(after_root, flags[1])
    elif args.before:
        known = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{args.before}^{{commit}}"], cwd=REPO,
                               capture_output=True)
        require(known.returncode == 0, f"--before {args.before}: no such commit in {REPO}")
        check_overrides(args.overrides)
        scratch = Path(tempfile.mkdtemp(prefix="pipeline-time-"))
        before_code = scratch / "before-code"
        subprocess.run(["git", "worktree", "add", "--detach", str(before_code), args.before], cwd=REPO, check=True)
        before_root, after_root = scratch / "before", scratch / "after"
        flags = (f"--before {args.before}'s run", "this tree's run")
        try:  # the roots and logs stay in scratch (a failed run's message names its log); the worktree goes
            result["before_wall_seconds"] = run_pipeline(before_code, before_root, args.overrides)
            result["after_wall_seconds"] = run_pipeline(REPO, after_root, args.overrides)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before_code)], cwd=REPO, check=False)
    else:
        parser.error("give --before REF, or --before-root and --after-root")
    result["before"], result["after"] = measured(before_root, flags[0]), measured(after_root, flags[1])
    result.update(compare(result["before"], result["after"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("after_over_before", "stage_after_over_before")}, indent=1))


if __name__ == "__main__":
    try:
        main()
    except PipelineError as error:  # bad input: one line, as the jobs print it (pipeline/entry.py run_guarded)
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
