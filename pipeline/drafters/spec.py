"""DrafterSpec: everything needed to build a drafter (the verifier's shapes and the drafter's own choices), saved as
a checkpoint's spec.json. Math-free."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass
class DrafterSpec:
    """Everything needed to build a drafter: the verifier's shapes plus the drafter's own choices."""

    algorithm: str
    verifier_name: str
    verifier_path: str
    # The drafter layer's HF config: the verifier's sizes in the layer layout of its family (model_type llama / qwen3,
    # pipeline/families.py).
    transformer_layer_config: dict[str, Any]
    aux_layer_ids: list[int]
    num_speculative_tokens: int
    mask_token_id: int
    num_layers: int = 1
    norm_before_residual: bool = True
    # Kept target ids (ascending) of a pruned draft vocabulary; null: the verifier's full vocabulary.
    draft_token_ids: Optional[list[int]] = None
    # Algorithm-specific architecture choices (DFlash block size, DSpark head ranks, ...).
    extra: dict[str, Any] = field(default_factory=dict)
    # The verifier's HF architecture (config.architectures[0]); empty in specs saved before it was recorded.
    verifier_architecture: str = ""
    # The verifier's final-logit soft cap c (Gemma: logits -> c * tanh(logits / c)); None: no cap.
    verifier_logit_softcap: Optional[float] = None

    @property
    def hidden_size(self) -> int:
        return int(self.transformer_layer_config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.transformer_layer_config["vocab_size"])

    @property
    def draft_vocab_size(self) -> int:
        return len(self.draft_token_ids) if self.draft_token_ids else self.vocab_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "DrafterSpec":
        return cls(**{k: v for k, v in values.items() if k != "draft_vocab_size"})

    def layer_config(self):
        """The verifier's HF config narrowed to the drafter's layers, with an explicit attention mask path."""
        from transformers import AutoConfig

        values = copy.deepcopy(self.transformer_layer_config)
        model_type = values.pop("model_type")
        config = AutoConfig.for_model(model_type, **values)
        config.num_hidden_layers = self.num_layers
        config._attn_implementation = "sdpa"
        return config
