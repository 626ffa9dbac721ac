"""Bounded load test of the served endpoint (loopback only), with and without the speculator, written as JSON.

    python benchmarks/serving.py --root <a finished pipeline run's paths.root> [--clients 32 --requests 64
        --max-tokens 48 --out benchmarks/results/serving_load.json]

Serves the root's champion with jobs/serve.py, then the verifier alone (serving.speculative=false), one after the
other on the same machine, and sends each the same requests (HumanEval prompts the drafter did not train on) from
`--clients` concurrent clients, greedy. Reports errors, p50/p99 latency, output tokens/s, whether the two answered
identically, and the served tau (vLLM's counters) against the evaluation's tau.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


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


def eval_prompts(count: int, root: Path) -> list[str]:
    """HumanEval prompts outside the root's training split, as completion prompts."""
    import datasets

    from pipeline.config import compose
    from pipeline.data.prompts import load_prompts

    trained = set(datasets.load_from_disk(str(next(root.glob("prompts/*/train"))))["sample_id"])
    rows = [r for r in load_prompts(compose([f"paths.root={root}"]).data) if r["sample_id"] not in trained]
    return [r["messages"][-1]["content"] for r in rows[:count]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "serving_load.json")
    args = parser.parse_args()

    import mlflow

    from pipeline.serving.metrics import scrape, served_metrics, spec_decode_counters
    from pipeline.serving.process import free_port, serve_job

    model = "SmolLM2-135M-Instruct-peagle"
    prompts = eval_prompts(args.requests, args.root)
    results = {}
    with tempfile.TemporaryDirectory() as logs:
        for name, extra in (("speculative", []), ("plain", ["serving.speculative=false"])):
            metrics_port = free_port()
            overrides = [f"paths.root={args.root}", f"serving.metrics_port={metrics_port}", *extra]
            with serve_job(overrides, free_port(), Path(logs) / f"{name}.log") as url:
                results[name] = asyncio.run(_load(url, model, prompts, args.clients, args.max_tokens))
                if name == "speculative":
                    time.sleep(15)  # Ray's metrics agent exports every few seconds
                    counters = spec_decode_counters(scrape(f"http://127.0.0.1:{metrics_port}/metrics"), model)
                    results[name]["served"] = served_metrics(counters)
    client = mlflow.MlflowClient(f"sqlite:///{args.root / 'mlflow' / 'mlflow.db'}")
    champion = client.get_model_version_by_alias(model, "champion")
    texts = {name: result.pop("texts") for name, result in results.items()}
    summary = {
        "clients": args.clients, "max_tokens": args.max_tokens, **results,
        "identical_outputs": sum(a == b for a, b in zip(texts["speculative"], texts["plain"])),
        "evaluated_tau": float(champion.tags["eval.pooled_tau"]),
        "speculative_over_plain_tokens_per_s": results["speculative"]["output_tokens_per_s"]
        / results["plain"]["output_tokens_per_s"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
