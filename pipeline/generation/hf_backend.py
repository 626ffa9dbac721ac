"""HF (transformers) verifier backend: greedy response regeneration and hidden-state capture.

Both classes are plain callables over pandas batches, so Ray Data can run them as actors (one verifier per actor)
and tests can call them directly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import torch

from pipeline.data.chat import prompt_ids, prompt_messages
from pipeline.data.store import write_shard
from pipeline.generation.verifier import DTYPES, load_verifier


class ResponseGenerator:
    """Regenerates the final assistant turn with the verifier (greedy) and returns its exact token ids."""

    def __init__(self, verifier_path: str, compute_dtype: str, max_new_tokens: int, max_length: int, threads: int):
        torch.set_num_threads(threads)
        self.model, self.tokenizer = load_verifier(verifier_path, compute_dtype)
        self.max_new_tokens, self.max_length = max_new_tokens, max_length

    def _generate(self, prompts: list[list[int]]) -> list[list[int]]:
        pad = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding for generation
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids, attention_mask=attention, max_new_tokens=self.max_new_tokens, do_sample=False,
                pad_token_id=pad, eos_token_id=self.tokenizer.eos_token_id,
            )
        responses = []
        for row in out[:, width:].tolist():
            if self.tokenizer.eos_token_id in row:
                row = row[: row.index(self.tokenizer.eos_token_id) + 1]  # keep the end marker: drafters learn it
            responses.append(row)
        return responses

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        conversations = [prompt_messages(json.loads(m)) for m in batch["messages_json"]]
        prompts = [prompt_ids(self.tokenizer, c) for c in conversations]
        fits = [len(p) <= self.max_length - 8 for p in prompts]
        responses = self._generate([p for p, ok in zip(prompts, fits) if ok]) if any(fits) else []
        rows, answers = [], iter(responses)
        for sample_id, conversation, prompt, ok in zip(batch["sample_id"], conversations, prompts, fits):
            if not ok:
                rows.append({"sample_id": sample_id, "messages_json": "", "input_ids": [], "loss_mask": [],
                             "skip_reason": f"prompt of {len(prompt)} tokens exceeds generation.max_length"})
                continue
            response = next(answers)
            text = self.tokenizer.decode(response, skip_special_tokens=True)
            input_ids = (prompt + response)[: self.max_length]
            loss_mask = ([0] * len(prompt) + [1] * len(response))[: self.max_length]
            messages = conversation + [{"role": "assistant", "content": text}]
            rows.append({"sample_id": sample_id, "messages_json": json.dumps(messages), "input_ids": input_ids,
                         "loss_mask": loss_mask, "skip_reason": ""})
        return pd.DataFrame(rows)


class HiddenStateCapturer:
    """Runs the verifier over regenerated samples and writes one store shard per batch."""

    def __init__(self, verifier_path: str, compute_dtype: str, layer_ids: list[int], store_dir: str,
                 store_dtype: str, threads: int):
        torch.set_num_threads(threads)
        self.model, _ = load_verifier(verifier_path, compute_dtype)
        self.layer_ids, self.store_dir, self.store_dtype = list(layer_ids), Path(store_dir), DTYPES[store_dtype]

    def hidden_states(self, input_ids: list[int]) -> dict[int, torch.Tensor]:
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([input_ids]), output_hidden_states=True)
        # HF's hidden_states[i] is the state after i layers (0 = embeddings); the last one is after the final norm.
        return {i: out.hidden_states[i][0].float() for i in self.layer_ids}  # each [T, H]

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        samples = []
        for sample_id, input_ids, loss_mask in zip(batch["sample_id"], batch["input_ids"], batch["loss_mask"]):
            ids = [int(t) for t in input_ids]
            samples.append({
                "sample_id": sample_id,
                "input_ids": torch.tensor(ids),
                "loss_mask": torch.tensor([int(m) for m in loss_mask]),
                "hidden": self.hidden_states(ids),
            })
        entry = write_shard(self.store_dir, samples, self.layer_ids, self.store_dtype)
        return pd.DataFrame([{"file": entry["file"], "num_samples": len(samples), "num_tokens": entry["num_tokens"]}])
