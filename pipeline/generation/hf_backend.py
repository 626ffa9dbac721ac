"""HF (transformers) verifier backend: response generation and hidden-state capture in one process.

Capture runs the base model (no LM head: its vocabulary-sized matmul is not needed) and keeps only the requested
layers through forward hooks instead of materialising every layer's output.
"""

from __future__ import annotations

import torch

from pipeline.families import text_decoder
from pipeline.verifier import DTYPES, cut_after_stop, load_verifier, num_layers, stop_token_ids


class HFVerifier:
    def __init__(self, verifier_path: str, compute_dtype: str, threads: int):
        torch.set_num_threads(threads)
        self.model, self.tokenizer = load_verifier(verifier_path, compute_dtype)
        self.dtype = DTYPES[compute_dtype]
        self.stop_token_ids = stop_token_ids(self.tokenizer, self.model.generation_config)

    def generate(self, prompts: list[list[int]], budgets: list[int], temperature: float, top_p: float,
                 seed: int) -> list[list[int]]:
        """Responses (left-padded batch); each is cut at its budget and just after the first stop id."""
        pad, stops = self.tokenizer.pad_token_id, list(self.stop_token_ids)
        width = max(len(p) for p in prompts)
        device = self.model.device
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {
            "do_sample": False}
        torch.manual_seed(seed)  # HF draws one stream per batch: sampled output depends on the batch's seed
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=attention, max_new_tokens=max(budgets),
                                      pad_token_id=pad, eos_token_id=stops or None, **sampling)
        return [cut_after_stop(row[:budget], self.stop_token_ids)
                for row, budget in zip(out[:, width:].tolist(), budgets)]

    def _layer_outputs(self, layer_ids: list[int]) -> tuple[dict[int, torch.nn.Module], int]:
        """Module whose output is hidden state i (HF convention: i = after i layers; the last is after the norm)."""
        base = text_decoder(self.model)
        count = num_layers(self.model)
        modules = {}
        for layer_id in layer_ids:
            if layer_id == 0:
                modules[layer_id] = base.embed_tokens
            elif layer_id == count:
                modules[layer_id] = base.norm
            else:
                modules[layer_id] = base.layers[layer_id - 1]
        return modules, count

    def forward_base(self, batch: list[list[int]]) -> torch.Tensor:
        """The plain verifier forward without capture, the benchmark's baseline: token ids of B samples -> the
        decoder's last hidden state [B, T_max, H] (right-padded to the longest sample), no gradient."""
        ids, attention = self._right_padded(batch)
        with torch.no_grad():
            return text_decoder(self.model)(input_ids=ids, attention_mask=attention).last_hidden_state

    def capture(self, batch: list[list[int]], layer_ids: list[int]) -> list[dict[int, torch.Tensor]]:
        """Per sample {layer_id: [T, H] float32} for the requested layers, from one padded forward."""
        modules, _ = self._layer_outputs(layer_ids)
        outputs: dict[int, torch.Tensor] = {}

        def keep(layer_id):
            def hook(module, args, output):
                outputs[layer_id] = output[0] if isinstance(output, tuple) else output
            return hook

        handles = [module.register_forward_hook(keep(i)) for i, module in modules.items()]
        try:
            self.forward_base(batch)
        finally:
            for handle in handles:
                handle.remove()
        return [{i: outputs[i][row, : len(ids)].float().cpu() for i in layer_ids} for row, ids in enumerate(batch)]

    def _right_padded(self, batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        # Right padding: causal attention keeps every real position independent of the padding after it.
        pad = self.tokenizer.pad_token_id
        width = max(len(ids) for ids in batch)
        device = self.model.device
        ids = torch.tensor([list(ids) + [pad] * (width - len(ids)) for ids in batch], device=device)
        attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in batch], device=device)
        return ids, attention
