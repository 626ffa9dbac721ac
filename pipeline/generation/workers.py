"""Ray Data callables: one verifier per actor. Each input row is one token-budget batch (`rows_json`); the actor
writes that batch's part (regeneration) or shard (capture) itself and returns a one-row summary, so results stream
to disk as they finish and nothing large travels back to the driver.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pandas as pd
import torch

from pipeline.data.store import write_shard
from pipeline.generation.parts import write_part
from pipeline.generation.regenerate import Limits, regenerate_conversations
from pipeline.verifier import DTYPES


def make_verifier(backend: str, verifier_path: str, compute_dtype: str, threads: int, **vllm_options):
    if backend == "vllm":
        from pipeline.generation.vllm_backend import VllmVerifier

        return VllmVerifier(verifier_path, compute_dtype, **vllm_options)
    from pipeline.generation.hf_backend import HFVerifier

    return HFVerifier(verifier_path, compute_dtype, threads)


def batch_seed(seed: int, sample_ids: list[str]) -> int:
    """A sampling seed fixed by the batch's content, so a rerun of the same batch samples the same answers."""
    return (seed * 1_000_003 + int(sample_ids[0][:8], 16)) % (2**31)


class RegenerateWorker:
    def __init__(self, backend: str, verifier_path: str, compute_dtype: str, threads: int, limits: dict,
                 sampling: dict, parts_dir: str, vllm_options: dict):
        self.verifier = make_verifier(backend, verifier_path, compute_dtype, threads, **vllm_options)
        self.limits, self.sampling, self.parts_dir = Limits(**limits), sampling, Path(parts_dir)

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        summaries = []
        for rows_json in batch["rows_json"]:
            rows = json.loads(rows_json)
            started = time.perf_counter()
            seed = batch_seed(self.sampling["seed"], [r["sample_id"] for r in rows])

            def generate(prompts, budgets, seed=seed):
                return self.verifier.generate(prompts, budgets, self.sampling["temperature"],
                                              self.sampling["top_p"], seed)

            results = regenerate_conversations([r["messages"] for r in rows], self.verifier.tokenizer, generate,
                                               self.limits, self.verifier.stop_token_ids)
            part = [{"sample_id": row["sample_id"], "messages_json": json.dumps(result["messages"]),
                     "input_ids": result["input_ids"], "loss_mask": result["loss_mask"],
                     "skip_reason": result["skip_reason"], "truncated": result["truncated"]}
                    for row, result in zip(rows, results)]
            write_part(self.parts_dir, part)
            summaries.append({"samples": len(rows), "response_tokens": sum(sum(r["loss_mask"]) for r in part),
                              "seconds": time.perf_counter() - started})
        return pd.DataFrame(summaries)


class CaptureWorker:
    def __init__(self, backend: str, verifier_path: str, compute_dtype: str, threads: int, layer_ids: list[int],
                 store_dir: str, store_dtype: str, compression: str, vllm_options: dict):
        self.verifier = make_verifier(backend, verifier_path, compute_dtype, threads, **vllm_options)
        self.layer_ids, self.store_dir = list(layer_ids), Path(store_dir)
        self.store_dtype, self.compression = DTYPES[store_dtype], compression

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        summaries = []
        for rows_json in batch["rows_json"]:
            rows = json.loads(rows_json)
            started = time.perf_counter()
            hidden = self.verifier.capture([r["input_ids"] for r in rows], self.layer_ids)
            forward_done = time.perf_counter()
            samples = [{"sample_id": r["sample_id"], "input_ids": torch.tensor(r["input_ids"]),
                        "loss_mask": torch.tensor(r["loss_mask"]), "hidden": h} for r, h in zip(rows, hidden)]
            entry = write_shard(self.store_dir, samples, self.layer_ids, self.store_dtype, self.compression)
            summaries.append({"entry_json": json.dumps(entry), "forward_seconds": forward_done - started,
                              "write_seconds": time.perf_counter() - forward_done})
        return pd.DataFrame(summaries)
