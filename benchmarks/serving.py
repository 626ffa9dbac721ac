"""Bounded load test of the served endpoint (loopback only), with and without the speculator, written as JSON.

    python benchmarks/serving.py --root <a finished pipeline run's paths.root> [--clients 32 --requests 64
        --max-tokens 48 --out benchmarks/results/serving_load.json] [Hydra overrides the run was made with]

Serves the root's champion with jobs/serve.py, then the verifier alone (serving.speculative=false), one after the
other on the same machine, and sends each the same requests (HumanEval prompts the drafter did not train on) from
`--clients` concurrent clients, greedy. Reports errors, p50/p99 latency, output tokens/s, whether the two answered
identically, and the served tau (vLLM's counters) against the evaluation's tau. The model is the one jobs/serve.py
serves for the root and the overrides (e.g. `drafter=dflash`): serving.model, else <registered name>@<gate alias>.
A root without that registered version, its training prompts or its MLflow store is one line naming --root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from pipeline.errors import PipelineError, require  # noqa: E402
from pipeline.evaluation.gate import tag_tau  # noqa: E402
from pipeline.fsutil import atomic_write_text, output_file_problem  # noqa: E402


async def _one(client, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    started = time.perf_counter()
    try:
        response = await client.post(f"{url}/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}, timeout=900)
        body = response.json()
        ok = response.status_code == 200
        return {"ok": ok, "seconds": time.perf_counter() - started, "text": body["choices"][0]["text"] if ok else "",
                "tokens": body["usage"]["completion_tokens"] if ok else 0}
    except Exception as error:  # a load test counts every failure, of whatever kind
        return {"ok": False, "seconds": time.perf_counter() - started, "text": "", "tokens": 0, "error": repr(error)}


async def _load(url: str, model: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for index, prompt in enumerate(prompts):
        queue.put_nowait((index, prompt))
    results: list = [None] * len(prompts)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients)) as client:
        async def worker():
            while not queue.empty():
                index, prompt = queue.get_nowait()
                results[index] = await _one(client, url, model, prompt, max_tokens)

        started = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(clients)])
        wall = time.perf_counter() - started
    latencies = sorted(r["seconds"] for r in results if r["ok"])
    return {"requests": len(prompts), "errors": sum(not r["ok"] for r in results), "wall_s": wall,
            "p50_s": statistics.median(latencies) if latencies else None,
            "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else None,
            "output_tokens_per_s": sum(r["tokens"] for r in results) / wall, "texts": [r["text"] for r in results]}


def eval_prompts(count: int, cfg) -> list[str]:
    """HumanEval prompts (offline, whatever the run's own data) outside the root's training split (checked by
    served_target), as completion prompts."""
    import datasets

    from pipeline.config import compose
    from pipeline.data.prompts import load_prompts, prompt_key
    from pipeline.evaluation.eval_sets import trained_prompts
    from pipeline.paths import StagePaths

    trained = trained_prompts(datasets.load_from_disk(str(StagePaths(cfg).prompts / "train")))
    rows = [r for r in load_prompts(compose(["data=humaneval"]).data) if prompt_key(r["messages"]) not in trained]
    return [r["messages"][-1]["content"] for r in rows[:count]]


def served_target(root: Path, overrides: list[str]) -> tuple:
    """(the composed config, the OpenAI model name jobs/serve.py serves the speculator as, the MLflow client, the
    registry version served or None for a runs:/ URI) of a finished pipeline root, named the way jobs/serve.py names
    it (pipeline/serving/job.py). Raises PipelineError naming --root when the root, its training prompts, its local
    MLflow store or the registered version is missing; creates nothing on the way."""
    require(root.is_dir(), f"--root {root}: no such folder (give a finished pipeline run's paths.root)")
    from pipeline.config import compose
    from pipeline.export.stage import registered_model_name
    from pipeline.paths import StagePaths
    from pipeline.serving.job import model_uri
    from pipeline.serving.registry import MODEL_URI, check_model_uri, served_model_name
    from pipeline.tracking import mlflow_errors_as, tracking_uri

    cfg = compose([f"paths.root={root}", *overrides])
    train = StagePaths(cfg).prompts / "train"
    require(train.is_dir(), f"--root {root}: no training prompts at {train} (run jobs/run_pipeline.py on it first, "
                            "with the same overrides)")
    db = root / "mlflow" / "mlflow.db"
    remote = cfg.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    require(bool(remote) or db.is_file(), f"--root {root}: no MLflow store at {db}, so nothing was exported there")
    uri = model_uri(cfg)
    check_model_uri(uri)
    import mlflow

    client = mlflow.MlflowClient(tracking_uri(cfg))
    model = MODEL_URI.match(uri)
    version = None
    if model:
        with mlflow_errors_as(f"--root {root}", f"no exported speculator {uri} in its registry"):
            version = (client.get_model_version_by_alias(model["name"], model["alias"]) if model["alias"]
                       else client.get_model_version(model["name"], model["version"]))
    return cfg, served_model_name(uri, registered_model_name(cfg)), client, version


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "serving_load.json")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides the root's run was made with (drafter=...)")
    args = parser.parse_args()
    for flag in ("clients", "requests", "max_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if output_file_problem(args.out):  # written after the load test: said now
        parser.error(output_file_problem(args.out))
    root = args.root.expanduser().resolve()
    cfg, model, client, version = served_target(root, args.overrides)

    from pipeline.serving.metrics import scrape, served_metrics, spec_decode_counters
    from pipeline.serving.process import free_port, serve_job

    prompts = eval_prompts(args.requests, cfg)
    require(bool(prompts), f"--root {root}: every HumanEval prompt is in its training split; none left to send")
    results = {}
    with tempfile.TemporaryDirectory() as logs:
        for name, extra in (("speculative", []), ("plain", ["serving.speculative=false"])):
            metrics_port = free_port()
            overrides = [f"paths.root={root}", *args.overrides, f"serving.metrics_port={metrics_port}", *extra]
            with serve_job(overrides, free_port(), Path(logs) / f"{name}.log") as url:
                results[name] = asyncio.run(_load(url, model, prompts, args.clients, args.max_tokens))
                if name == "speculative":
                    time.sleep(15)  # Ray's metrics agent exports every few seconds
                    counters = spec_decode_counters(scrape(f"http://127.0.0.1:{metrics_port}/metrics"), model)
                    results[name]["served"] = served_metrics(counters)
    texts = {name: result.pop("texts") for name, result in results.items()}
    summary = {
        "model": model, "version": version.version if version else None,
        "clients": args.clients, "max_tokens": args.max_tokens, **results,
        "identical_outputs": sum(a == b for a, b in zip(texts["speculative"], texts["plain"])),
        "evaluated_tau": tag_tau(version.tags) if version else None,  # None for a tag edited to no number
        "speculative_over_plain_tokens_per_s": results["speculative"]["output_tokens_per_s"]
        / results["plain"]["output_tokens_per_s"],
    }
    atomic_write_text(Path(args.out), json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    try:
        main()
    except PipelineError as error:  # bad input: one line, as the jobs print it (pipeline/entry.py run_guarded)
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
