"""Learning curve: real acceptance per eval set against training tokens, next to vLLM's n-gram prompt lookup.

    python benchmarks/quality_curve.py --root DIR [--drafters peagle eagle3] [--steps 1000] [--points 5]
        [--prompts-per-set 8] [--max-new-tokens 48] [--work DIR2] [--out FILE] [--update]

DIR holds the general store (`python jobs/generate.py experiment=quality_cpu paths.root=DIR`). For each drafter,
`jobs/run_pipeline.py experiment=quality_cpu` runs on a root of its own that links DIR's prompts, regenerated set and
store, for --steps optimizer steps with a checkpoint every steps / points steps (val.tau and val.proxy_tau at each,
the final checkpoint chosen by val.tau), then evaluates on held_out, code, math and chat and measures the export in
vLLM. Every checkpoint's drafter (the train run's MLflow artifacts `checkpoints/step-N`) is then decoded by the
lossless reference decoder on the evaluate stage's own requests, per set: pooled tau and alpha_1 against training
tokens (steps x sequences per step x the store's mean tokens per sample). vLLM's n-gram prompt lookup decodes the
same requests, and is compared as tokens per verifier forward (its counters count a step without an n-gram match
as no draft, so its counter tau alone would flatter it; every step of ours drafts K, so our tau is already tokens
per forward). The PNG (tau per set vs tokens, the n-gram level dashed) goes to the drafter's train run in MLflow
and beside FILE. Default FILE: benchmarks/results/quality_curve.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.training import (  # noqa: E402
    check_overrides,
    check_store_root,
    check_work,
    fresh_root,
    machine_info,
    write_json,
)
from pipeline.errors import PipelineError, read_json  # noqa: E402
from pipeline.fsutil import output_file_problem  # noqa: E402

DRAFTERS = ["peagle", "eagle3"]
EVAL_SETS = ["held_out", "code", "math", "chat"]
NGRAM = (1, 4)  # n-gram sizes vLLM's prompt lookup matches, smallest to largest
TARGETS = {"held_out": {"tau": 2.0, "alpha1": 0.6}, "chat": {"tau": 1.6}}  # the issue's, for P-EAGLE at K=4


def pipeline_overrides(work: Path, algorithm: str, args) -> list[str]:
    every = max(1, args.steps // args.points)
    return ["experiment=quality_cpu", f"paths.root={work}", f"drafter={algorithm}",
            f"training.max_steps={args.steps}", f"training.checkpoint_every={every}",
            f"training.keep_checkpoints={args.points + 1}", f"training.warmup_steps={max(1, args.steps // 40)}",
            f"evaluation.datasets=[{','.join(EVAL_SETS)}]", f"evaluation.prompts_per_set={args.prompts_per_set}",
            f"evaluation.max_new_tokens={args.max_new_tokens}", "evaluation.profile_prompts=0",
            "evaluation.vllm.enabled=true", *args.override]


def run_pipeline(root: Path, work: Path, algorithm: str, args) -> list[str]:
    fresh_root(root, work)
    if (root / "synthetic").is_dir():  # the verifier's requests, training's and the eval sets'
        (work / "synthetic").symlink_to(root / "synthetic", target_is_directory=True)
    overrides = pipeline_overrides(work, algorithm, args)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    log = work / "pipeline.log"
    with log.open("w") as out:
        finished = subprocess.run([sys.executable, "jobs/run_pipeline.py", *overrides], cwd=REPO, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=4 * 3600)
    if finished.returncode != 0:
        tail = log.read_text().strip().splitlines()[-1:]
        raise RuntimeError(f"{algorithm}: jobs/run_pipeline.py exited {finished.returncode}: {tail} (log: {log})")
    return overrides


def train_run(cfg):
    """(MLflow client, the newest stage=train run) of the config's tracking store."""
    import mlflow

    from pipeline.tracking import tracking_uri

    client = mlflow.MlflowClient(tracking_uri(cfg))
    experiment = client.get_experiment_by_name(cfg.tracking.experiment_name)
    (run,) = client.search_runs([experiment.experiment_id], filter_string="tags.stage = 'train'",
                                order_by=["attributes.start_time DESC"], max_results=1)
    return client, run


def metric_by_step(client, run_id: str, name: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, name)}


def checkpoint_folders(client, run_id: str, into: Path) -> dict[int, Path]:
    """step -> local folder of each checkpoint the train run logged (spec, weights, train state)."""
    folders = {}
    for entry in client.list_artifacts(run_id, "checkpoints"):
        step = int(entry.path.rsplit("step-", 1)[1])
        folders[step] = Path(client.download_artifacts(run_id, entry.path, str(into)))
    return dict(sorted(folders.items()))


def requests_by_set(evaluation_folder: Path) -> dict[str, list[dict]]:
    by_set: dict[str, list[dict]] = {}
    for request in json.loads((evaluation_folder / "requests.json").read_text()):
        by_set.setdefault(request["set"], []).append(request)
    return by_set


def reference_per_set(verifier, stop_token_ids: tuple[int, ...], checkpoint: Path, sets: dict[str, list[dict]],
                      k: int, max_new_tokens: int, batch_size: int) -> dict[str, dict]:
    """Pooled tau and alpha_1 per set of one checkpoint's drafter, greedy, by the lossless reference decoder."""
    from pipeline.evaluation.measured_drafter import decoding_drafter
    from pipeline.evaluation.reference_decoder import SpeculativeDecoder
    from pipeline.metrics import merged

    # MLflow's copy of a checkpoint carries no integrity record (those seal Ray's copy); it is this run's own.
    drafter = decoding_drafter(checkpoint, verified=False).to(verifier.device)
    decoder = SpeculativeDecoder(verifier, drafter, k)
    result = {}
    for name, rows in sets.items():
        prompts, counts = [r["prompt_ids"] for r in rows], []
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start:start + batch_size]
            counts += [c for _, c in decoder.generate_batch(batch, max_new_tokens, stop_token_ids)]
        total = merged(counts)
        result[name] = {"tau": round(total.tau, 4), "alpha1": round(total.conditional_acceptance[0], 4)}
    return result


def vllm_run(verifier_path: str, drafter_args: list[str], sets: dict[str, list[dict]], k: int,
             max_new_tokens: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="quality-curve-") as scratch:
        prompts, out = Path(scratch) / "prompts.json", Path(scratch) / "result.json"
        prompts.write_text(json.dumps({name: [r["prompt_ids"] for r in rows] for name, rows in sets.items()}))
        command = [sys.executable, "-m", "pipeline.evaluation.vllm_runner", "--verifier", verifier_path,
                   *drafter_args, "--num-speculative-tokens", str(k), "--max-tokens", str(max_new_tokens),
                   "--prompts", str(prompts), "--out", str(out)]
        finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=3600)
        if finished.returncode != 0:
            raise RuntimeError(f"vLLM ({drafter_args}): {finished.stderr.strip().splitlines()[-1:]}")
        return json.loads(out.read_text())["speculative"]["per_set"]


def tokens_per_forward(counters: dict, tokens: list[list[int]]) -> dict:
    """From vLLM's counters and outputs: every forward emits one token plus the drafts it accepted, so forwards =
    emitted tokens - accepted drafts. `counter_tau` (1 + accepted / drafts) counts only steps that drafted."""
    emitted, accepted = sum(len(t) for t in tokens), counters["num_accepted_tokens"]
    drafts = counters["num_drafts"]
    return {"tokens_per_forward": round(emitted / max(emitted - accepted, 1), 4),
            "counter_tau": round(1 + accepted / drafts, 4) if drafts else None,
            "steps_with_drafts": drafts, "forwards": emitted - accepted}


def curve_of(root: Path, work: Path, algorithm: str, args) -> dict:
    from pipeline.config import compose
    from pipeline.data.store import load_manifest
    from pipeline.paths import StagePaths
    from pipeline.verifier import load_verifier, resolve_verifier_path, stop_token_ids

    started = time.perf_counter()
    overrides = run_pipeline(root, work, algorithm, args)
    seconds = round(time.perf_counter() - started, 1)
    cfg = compose(overrides)
    paths = StagePaths(cfg)
    report = json.loads((paths.evaluation / "report.json").read_text())
    served = json.loads((paths.evaluation / "vllm.json").read_text())
    client, run = train_run(cfg)
    metrics = {name: metric_by_step(client, run.info.run_id, name)
               for name in ("val.tau", "val.alpha_pos1", "val.proxy_tau", "train.loss")}
    manifest = load_manifest(paths.store)
    tokens_per_sequence = manifest["num_tokens"] / manifest["num_samples"]
    sequences_per_step = int(cfg.training.num_workers) * int(cfg.training.micro_batch_size) * int(
        cfg.training.grad_accum_steps)
    sets = requests_by_set(paths.evaluation)
    verifier_path = resolve_verifier_path(cfg.verifier)
    verifier, tokenizer = load_verifier(verifier_path, cfg.verifier.compute_dtype)
    k = int(report["num_speculative_tokens"])
    stops = stop_token_ids(tokenizer, verifier.generation_config)
    points = []
    with tempfile.TemporaryDirectory(prefix="checkpoints-") as scratch:
        for step, folder in checkpoint_folders(client, run.info.run_id, Path(scratch)).items():
            point = {"step": step, "training_tokens": round(step * sequences_per_step * tokens_per_sequence),
                     **{name: round(series[step], 4) for name, series in metrics.items() if step in series},
                     "per_set": reference_per_set(verifier, stops, folder, sets, k, args.max_new_tokens,
                                                  int(cfg.evaluation.batch_size))}
            points.append(point)
            print(json.dumps(point), flush=True)
    final = run.data.metrics
    return {
        "machine": machine_info(),  # per drafter: --update keeps curves measured on other machines
        "overrides": list(args.override),  # the recipe beyond experiment=quality_cpu
        "steps": args.steps, "seconds": seconds, "sequences_per_step": sequences_per_step,
        "tokens_per_sequence": round(tokens_per_sequence, 1), "k": k, "train_run_id": run.info.run_id,
        "points": points,
        "chosen_by_val_tau": final.get("train.best_step_by_val_tau"),
        "chosen_by_proxy_tau": final.get("train.best_step_by_proxy_tau"),
        "val_tau_at_proxy_choice": final.get("train.val_tau_at_proxy_choice"),
        "val_tau_best": final.get("train.best_val_tau"),
        "proxy_tau_spearman": final.get("train.proxy_tau_spearman"),
        "final": {"reference_decoder": {name: round(figures["pooled_tau"], 4)
                                        for name, figures in report["datasets"].items()},
                  "vllm": {"tau": round(served["tau"], 4),
                           "requests_matching_reference": served.get("requests_matching_reference")}},
        "_sets": sets, "_verifier_path": verifier_path, "_client": client,
    }


def ngram_baseline(verifier_path: str, sets: dict[str, list[dict]], k: int, max_new_tokens: int) -> dict:
    per_set = vllm_run(verifier_path, ["--ngram", *map(str, NGRAM)], sets, k, max_new_tokens)
    return {name: tokens_per_forward(figures["counters"], figures["tokens"]) for name, figures in per_set.items()}


def plot(curve: dict, ngram: dict, algorithm: str, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for index, name in enumerate(EVAL_SETS):
        xs = [p["training_tokens"] / 1e6 for p in curve["points"]]
        ys = [p["per_set"][name]["tau"] for p in curve["points"] if name in p["per_set"]]
        if len(ys) != len(xs):
            continue
        color = f"C{index}"
        axes.plot(xs, ys, marker="o", color=color, label=f"{name}")
        if name in ngram:
            axes.axhline(ngram[name]["tokens_per_forward"], color=color, linestyle="--", linewidth=1)
    axes.set_xlabel("training tokens (millions)")
    axes.set_ylabel(f"tau, tokens per verifier forward (K={curve['k']})")
    axes.set_title(f"{algorithm}: reference-decoder tau per eval set (dashed: vLLM n-gram)", fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def targets_met(curve: dict, ngram: dict) -> dict:
    """The issue's targets at the checkpoint val.tau chose (the final one the pipeline exported; the last point
    when none was chosen), and being above n-gram on every set."""
    chosen = [p for p in curve["points"] if p["step"] == curve.get("chosen_by_val_tau")] or curve["points"][-1:]
    last = chosen[0]["per_set"] if chosen else {}
    met = {f"{name}.{key}>={value}": last.get(name, {}).get(key, 0.0) >= value
           for name, goals in TARGETS.items() for key, value in goals.items()}
    met.update({f"{name}>ngram": last.get(name, {}).get("tau", 0.0) > ngram[name]["tokens_per_forward"]
                for name in ngram})
    return met


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, help="an output root with the general store")
    parser.add_argument("--drafters", nargs="+", default=DRAFTERS, choices=["peagle", "eagle3", "dflash"])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--points", type=int, default=5, help="checkpoints along the run")
    parser.add_argument("--prompts-per-set", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--override", nargs="*", default=[], help="more Hydra overrides for the pipeline job")
    parser.add_argument("--work", help="default: <root>/bench-quality-curve")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "quality_curve.json"))
    parser.add_argument("--update", action="store_true", help="keep FILE's other drafters")
    args = parser.parse_args()
    # Every check before the first drafter's work folder is emptied (fresh_root) or FILE is touched.
    for flag in ("steps", "points", "prompts_per_set", "max_new_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if args.points > args.steps:
        parser.error(f"--points {args.points}: more checkpoints than --steps {args.steps}")
    root = Path(args.root).expanduser().resolve()
    try:
        check_store_root(root)
    except PipelineError as error:
        parser.error(f"{error} (the general store: experiment=quality_cpu)")
    work = Path(args.work).expanduser().resolve() if args.work else root / "bench-quality-curve"
    check_work(root, work, args.drafters)  # fresh_root empties work/<drafter>: never the root or a folder holding it
    out = Path(args.out)
    if output_file_problem(out):
        parser.error(output_file_problem(out))
    try:  # not UTF-8, not JSON, nested past the recursion limit: one line
        result = read_json(out, f"--out {out}: --update") if args.update and out.is_file() else {}
    except PipelineError as error:
        parser.error(str(error))
    drafters = result.get("drafters", {}) if isinstance(result, dict) else None
    if not isinstance(drafters, dict) or not all(isinstance(curve, dict) for curve in drafters.values()):
        parser.error(f"--out {out}: --update needs an earlier quality_curve JSON object")
    # a mistyped --override fails here, not in the job after fresh_root
    check_overrides([pipeline_overrides(work / algorithm, algorithm, args) for algorithm in args.drafters])
    result.update({"machine": machine_info(), "root": str(root), "eval_sets": EVAL_SETS,
                   "prompts_per_set": args.prompts_per_set, "max_new_tokens": args.max_new_tokens,
                   "ngram": {"prompt_lookup_min": NGRAM[0], "prompt_lookup_max": NGRAM[1]}, "targets": TARGETS})
    result.setdefault("drafters", {})
    for algorithm in args.drafters:
        curve = curve_of(root, work / algorithm, algorithm, args)
        sets, verifier_path, client = curve.pop("_sets"), curve.pop("_verifier_path"), curve.pop("_client")
        if "ngram_baseline" not in result:  # the same requests for every drafter: one n-gram run
            result["ngram_baseline"] = ngram_baseline(verifier_path, sets, curve["k"], args.max_new_tokens)
        curve["targets_met"] = targets_met(curve, result["ngram_baseline"])
        png = plot(curve, result["ngram_baseline"], algorithm, out.with_name(f"quality_curve_{algorithm}.png"))
        client.log_artifact(curve["train_run_id"], str(png), "quality_curve")
        result["drafters"][algorithm] = curve
        write_json(result, out)  # after each drafter: a later failure keeps the finished ones
    print(json.dumps({name: c["targets_met"] for name, c in result["drafters"].items()}, indent=1))


if __name__ == "__main__":
    try:
        main()
    except PipelineError as error:  # bad input: one line and exit 2, as the jobs print it (pipeline/entry.py)
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
