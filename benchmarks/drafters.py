"""Drafter benchmarks on SmolLM2, written as JSON.

    python benchmarks/drafters.py harness [--steps 150] [--root outputs/bench-drafters] [--out FILE]
        One Hydra multirun over every registered drafter (`jobs/run_pipeline.py -m drafter=eagle3,peagle,...`)
        on one shared feature store, the same data and steps, each evaluated by the reference decoder at K=7.
        Reports pooled tau and per-position acceptance per drafter.

    python benchmarks/drafters.py loss-scaling [--out FILE]
        Peak memory and step time (forward + backward) of the P-EAGLE and DFlash losses at SmolLM2's sizes as the
        sequence length N and the draft depth K grow: sparsified (as trained) vs naive (every position, every K).
        Each point runs in its own process so peak RSS is that point's alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from pipeline.drafters import DRAFTERS  # noqa: E402  (every registered drafter, in registration order)
from pipeline.fsutil import atomic_write_text, output_file_problem  # noqa: E402

K = 7


def harness(args) -> dict:
    root = Path(args.root).resolve()
    overrides = [f"paths.root={root}", f"drafter.num_speculative_tokens={K}", f"evaluation.num_speculative_tokens={K}",
                 f"training.max_steps={args.steps}"]
    command = [sys.executable, "jobs/run_pipeline.py", "-m", f"drafter={','.join(DRAFTERS)}", *overrides]
    started = time.time()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    subprocess.run(command, cwd=REPO, env=env, check=True)
    # DSpark once more with the confidence cut (the default sends every draft, as vLLM serves it): what the cut
    # costs in tau and saves in drafts sent.
    subprocess.run([sys.executable, "jobs/evaluate.py", "drafter=dspark", "drafter.confidence_threshold=0.3",
                    *overrides], cwd=REPO, env=env, check=True)
    results = {"command": " ".join(command[1:]), "seconds": round(time.time() - started, 1), "K": K,
               "training_steps": args.steps, "drafters": {}}
    for report_file in sorted(root.glob("eval/*/report.json")):
        report = json.loads(report_file.read_text())
        if report["num_speculative_tokens"] != K:
            continue
        spec = json.loads((Path(report["checkpoint"]) / "spec.json").read_text())
        name = report["drafter"]
        if report.get("confidence_threshold") is not None:
            name = f"{name}@threshold={report['confidence_threshold']}"
        results["drafters"][name] = {
            "pooled_tau": report["pooled_tau"], "per_request_tau": report["per_request_tau"],
            "conditional_acceptance": report["conditional_acceptance"],
            "cumulative_acceptance": report["cumulative_acceptance"], "verify_steps": report["verify_steps"],
            "drafts_per_step": report["drafts_per_step"], "checkpoint": report["checkpoint"],
            "num_layers": spec["num_layers"], "aux_layer_ids": spec["aux_layer_ids"],
        }
    results["stores_used"] = len(list(root.glob("stores/*/manifest.json")))
    return results


def _loss_point(algorithm: str, length: int, depth: int, naive: bool) -> dict:
    """One measurement, in this process: build a SmolLM2-sized drafter, run one loss forward + backward."""
    import torch

    from pipeline.drafters.build import build_drafter
    from pipeline.drafters.spec import DrafterSpec

    torch.manual_seed(0)
    torch.set_num_threads(2)
    hidden, vocab = 576, 49152
    layer = {"model_type": "llama", "hidden_size": hidden, "intermediate_size": 1536, "num_attention_heads": 9,
             "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5, "vocab_size": vocab,
             "max_position_embeddings": 8192, "rope_theta": 100000.0}
    from pipeline.drafters import drafter_class

    cls = drafter_class(algorithm)
    aux_ids = [2, 15, 27] if algorithm == "peagle" else [1, 8, 14, 20, 27]
    spec = DrafterSpec(algorithm=algorithm, verifier_name="SmolLM2-135M", verifier_path="-",
                       transformer_layer_config=cls.adapt_layer_config(layer), aux_layer_ids=aux_ids,
                       num_speculative_tokens=depth, mask_token_id=0,
                       extra={k: {"causal_block": False}.get(k) for k in cls.extra_keys})
    model = build_drafter(spec, (torch.randn(vocab, hidden) * 0.02, torch.randn(vocab, hidden) * 0.02))
    sample = {"aux": torch.randn(length, len(aux_ids) * hidden), "last": torch.randn(length, hidden),
              "input_ids": torch.randint(0, vocab, (length,)), "loss_mask": torch.ones(length, dtype=torch.long)}
    sample["loss_mask"][: length // 8] = 0  # a prompt
    options = cls.config_class(max_anchors=64)  # the schema's defaults (P-EAGLE: depth_keep_decay 0.8)
    if naive:
        options = options.deterministic()
    baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    timings = []
    for _ in range(2):  # the first step warms allocators up; report the second
        started = time.perf_counter()
        loss, _, total = model.training_loss([sample], options, torch.Generator().manual_seed(0))
        loss.backward()
        timings.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"algorithm": algorithm, "N": length, "K": depth, "loss": "naive" if naive else "sparsified",
            "step_seconds": round(timings[-1], 3), "peak_extra_mb": round((peak_kb - baseline_kb) / 1024, 1),
            "rows_with_loss": int(total.sum())}


def loss_scaling(args) -> dict:
    points = []
    for algorithm in ("peagle", "dflash"):
        for length in (128, 256, 512):
            for depth in (4, 8):
                for naive in (False, True):
                    command = [sys.executable, __file__, "_point", algorithm, str(length), str(depth), str(int(naive))]
                    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
                    if result.returncode != 0:
                        points.append({"algorithm": algorithm, "N": length, "K": depth, "naive": naive,
                                       "error": result.stderr.strip().splitlines()[-1:]})
                        continue
                    points.append(json.loads(result.stdout.strip().splitlines()[-1]))
                    print(points[-1], flush=True)
    ratios = []
    for point in points:
        if point.get("loss") != "sparsified":
            continue
        naive = next((p for p in points if p.get("loss") == "naive" and p["algorithm"] == point["algorithm"]
                      and p["N"] == point["N"] and p["K"] == point["K"]), None)
        if naive:
            ratios.append({"algorithm": point["algorithm"], "N": point["N"], "K": point["K"],
                           "time_ratio_sparse_over_naive": round(point["step_seconds"] / naive["step_seconds"], 3),
                           "memory_ratio_sparse_over_naive":
                               round(point["peak_extra_mb"] / max(naive["peak_extra_mb"], 1e-6), 3)})
    return {"points": points, "ratios": ratios}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_point":
        algorithm, length, depth, naive = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), bool(int(sys.argv[5]))
        print(json.dumps(_loss_point(algorithm, length, depth, naive)))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("harness")
    bench.add_argument("--steps", type=int, default=150)
    bench.add_argument("--root", default=str(REPO / "outputs" / "bench-drafters"))
    bench.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "drafters_harness.json"))
    scaling = sub.add_parser("loss-scaling")
    scaling.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "loss_scaling.json"))
    args = parser.parse_args()
    if args.command == "harness" and args.steps < 1:
        parser.error(f"--steps {args.steps}: must be at least 1")
    if args.command == "harness" and Path(args.root).exists() and not Path(args.root).is_dir():
        parser.error(f"--root {args.root}: is a file; give the output root folder")
    if output_file_problem(args.out):
        parser.error(output_file_problem(args.out))
    result = harness(args) if args.command == "harness" else loss_scaling(args)
    atomic_write_text(Path(args.out), json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
