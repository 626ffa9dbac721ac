"""Hidden-state capture benchmark on SmolLM2, written as JSON.

    python benchmarks/generation.py [--samples 48] [--rounds 3] [--out benchmarks/results/generation.json]

On the same token-budget batches of real chat samples (HumanEval prompts + SmolLM2's own greedy answers when a
regenerated set is given, else the prompts alone), in one process and interleaved batch by batch so machine noise
hits both sides alike:
  - plain: the verifier's forward (base model, no LM head) - the least any capture must pay;
  - capture+write: our HF capture of the store's layers + writing the shard (bf16, and fp8 with per-row scales).
Reports throughput (tokens/s), the ratio capture/plain (goal >= 0.9), and stored bytes per token against
layers x hidden x 2 (the raw bf16 size of the captured rows).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from pipeline.fsutil import atomic_write_text, output_file_problem  # noqa: E402


def chat_samples(tokenizer, count: int, regenerated: str | None) -> list[list[int]]:
    if regenerated:
        import datasets

        return [list(r["input_ids"]) for r in datasets.load_from_disk(regenerated)][:count]
    from types import SimpleNamespace

    from pipeline.data.chat import prompt_ids
    from pipeline.data.prompts import load_prompts

    prompts = load_prompts(SimpleNamespace(source="humaneval", path=None, split="train", messages_field="messages",
                                           prompt_field="prompt", system_prompt=None))
    return [prompt_ids(tokenizer, row["messages"]) for row in prompts.select(range(count))]


def run(args) -> dict:
    import torch

    from pipeline.config import compose
    from pipeline.data.store import write_shard
    from pipeline.drafters.build import store_layer_ids
    from pipeline.generation.batching import pack_by_token_budget
    from pipeline.generation.hf_backend import HFVerifier
    from pipeline.verifier import resolve_verifier_path

    cfg = compose([])
    verifier = HFVerifier(resolve_verifier_path(cfg.verifier), "float32", threads=2)
    config = verifier.model.config
    layers = store_layer_ids(None, int(config.num_hidden_layers))
    samples = chat_samples(verifier.tokenizer, args.samples, args.regenerated)
    gen = cfg.generation
    batches = pack_by_token_budget([len(s) for s in samples], gen.capture_max_batch_tokens or gen.max_batch_tokens,
                                   gen.capture_batch_size or gen.batch_size)
    seconds = {"plain": 0.0, "capture_write_bf16": 0.0, "capture_write_fp8": 0.0}
    stored_bytes = {"capture_write_bf16": 0, "capture_write_fp8": 0}
    tokens = 0
    with tempfile.TemporaryDirectory() as folder:
        verifier.forward_base([samples[0]])  # warm-up
        for round_index in range(args.rounds):
            for batch_index, batch in enumerate(batches):
                rows = [samples[i] for i in batch]
                tokens += sum(len(r) for r in rows)
                started = time.perf_counter()
                verifier.forward_base(rows)
                seconds["plain"] += time.perf_counter() - started
                for compression in ("bf16", "fp8"):
                    started = time.perf_counter()
                    hidden = verifier.capture(rows, layers)
                    entry = write_shard(
                        Path(folder) / compression,
                        [{"sample_id": f"{round_index}-{batch_index}-{j}", "input_ids": torch.tensor(r),
                          "loss_mask": torch.ones(len(r)), "hidden": h} for j, (r, h) in enumerate(zip(rows, hidden))],
                        layers, torch.bfloat16, "fp8" if compression == "fp8" else "none")
                    key = f"capture_write_{compression}"
                    seconds[key] += time.perf_counter() - started
                    stored_bytes[key] += (Path(folder) / compression / entry["file"]).stat().st_size
    raw_bytes_per_token = len(layers) * int(config.hidden_size) * 2
    throughput = {name: tokens / s for name, s in seconds.items()}
    return {
        "verifier": cfg.verifier.name, "layers": layers, "hidden_size": int(config.hidden_size),
        "samples": len(samples), "batches": len(batches), "rounds": args.rounds, "tokens": tokens,
        "tokens_per_s": {k: round(v, 1) for k, v in throughput.items()},
        "capture_over_plain": {k: round(throughput[k] / throughput["plain"], 3)
                               for k in ("capture_write_bf16", "capture_write_fp8")},
        "goal_capture_over_plain": 0.9,
        "bytes_per_token": {k: round(v / tokens, 1) for k, v in stored_bytes.items()},
        "layers_x_hidden_x_2": raw_bytes_per_token,
        "stored_over_raw_bf16": {k: round(v / tokens / raw_bytes_per_token, 3) for k, v in stored_bytes.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--regenerated", default=None, help="a regenerated dataset folder (prompts + answers)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "generation.json"))
    args = parser.parse_args()
    for flag in ("samples", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} {getattr(args, flag)}: must be at least 1")
    if args.regenerated and not (Path(args.regenerated) / "dataset_info.json").is_file():
        parser.error(f"--regenerated {args.regenerated}: no saved dataset there (a regenerated/<key> folder)")
    if output_file_problem(args.out):
        parser.error(output_file_problem(args.out))
    results = run(args)
    atomic_write_text(Path(args.out), json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
