"""Build a drafter for a verifier: its spec from config + the verifier's HF config, and its frozen tensors."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from safetensors import safe_open

from pipeline.drafters.base import DrafterBase
from pipeline.drafters.spec import DrafterSpec
from pipeline.errors import PipelineError
from pipeline.families import (
    family_of,
    load_verifier_config,
    logit_softcap,
    text_weights_prefix,
    verifier_config_dict,
)

if TYPE_CHECKING:
    from pipeline.config.schema import DrafterConfig


def default_aux_layer_ids(algorithm: str, num_verifier_layers: int) -> list[int]:
    from pipeline.drafters import drafter_class

    return drafter_class(algorithm).default_aux_layer_ids(num_verifier_layers)


def store_layer_ids(configured_aux: Optional[list[int]], num_verifier_layers: int) -> list[int]:
    """The layers a store captures: the union every registered drafter needs by default (or the configured
    aux layers), plus the last layer for targets. One store then feeds a multirun over all drafters."""
    from pipeline.drafters import DRAFTERS

    if configured_aux:
        wanted = set(configured_aux)
    else:
        wanted = {i for cls in DRAFTERS.values() for i in cls.default_aux_layer_ids(num_verifier_layers)}
    return sorted(wanted | {num_verifier_layers})


def _layer_config_dict(verifier_config: Any) -> dict[str, Any]:
    """The verifier text model's sizes in its family's drafter layer layout (pipeline/families.py): a Qwen3-MoE
    verifier gives a dense Qwen3 layer of its dense intermediate_size, a Gemma verifier a Llama layer."""
    keep = (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "max_position_embeddings", "vocab_size",
        "attention_bias", "mlp_bias", "hidden_act", "tie_word_embeddings", "bos_token_id", "eos_token_id",
        "pad_token_id",
    )
    family = family_of(verifier_config.model_type)
    values = verifier_config.to_dict()
    layer = {key: values[key] for key in keep if key in values and values[key] is not None}
    rope = layer.get("rope_parameters")
    if isinstance(rope, dict) and "full_attention" in rope:
        # Gemma keeps one rope per layer type (local sliding-window and global layers; Gemma-4's global one is a
        # partial "proportional" rope): the drafter's single layer attends globally, with a plain rope of the
        # global layers' theta, which Llama and Qwen3 layers (and vLLM's drafters) implement.
        layer["rope_parameters"] = {"rope_type": "default", "rope_theta": rope["full_attention"]["rope_theta"]}
    # Gemma names its activation hidden_activation (gelu): a Llama drafter layer keeps silu, the only activation
    # vLLM's Llama MLP implements.
    layer.setdefault("hidden_act", "silu")
    return {"model_type": family.drafter_layer_type, **layer}


def check_aux_layer_ids(aux: list[int], num_layers: int) -> None:
    """Aux layer id i is the residual stream after verifier layer i (HF `hidden_states[i]`), which vLLM's EAGLE-3
    models collect as the input of layer i: so 1 <= i < num_layers (layer 0 has no residual yet; HF's state after
    the last layer is taken after the final norm, which vLLM never feeds the drafter), distinct, in increasing order
    (vLLM concatenates them in layer order; fc trained on another order reads the wrong blocks)."""
    if len(set(aux)) != len(aux):
        raise PipelineError(f"drafter.aux_layer_ids: {aux} repeats a layer (speculators and vLLM need distinct ids)")
    for layer_id in aux:
        if not 1 <= layer_id < num_layers:
            raise PipelineError(f"drafter.aux_layer_ids: {layer_id} is outside 1..{num_layers - 1} for this verifier "
                                f"of {num_layers} layers (layer {num_layers}'s state is stored after the final norm, "
                                "which vLLM does not feed the drafter)")
    if aux != sorted(aux):
        raise PipelineError(f"drafter.aux_layer_ids: {aux} is not in increasing order; vLLM concatenates the aux "
                            f"hidden states in layer order ({sorted(aux)})")


def check_mask_token_id(mask_token_id: int, vocab_size: int) -> None:
    """The mask token fills a block's draft positions through the verifier's embedding [V, H]: it must index it.
    Raises PipelineError naming drafter.mask_token_id."""
    if not 0 <= int(mask_token_id) < int(vocab_size):
        raise PipelineError(f"drafter.mask_token_id: {mask_token_id} is outside the verifier's vocabulary "
                            f"(0..{int(vocab_size) - 1})")


def check_configured_drafter(drafter_cfg: DrafterConfig, verifier_path: str) -> None:
    """Before any stage: the configured drafter is built for the verifier's config.json on torch's meta device (no
    memory, no weights), so every check its spec and its modules make against the verifier (aux layer ids, the mask
    token, DFlash2's convolution groups and selector candidates) refuses a bad value in a second rather than after
    generation and capture. Raises PipelineError naming the field."""
    from pipeline.drafters import drafter_class

    verifier_config = load_verifier_config(verifier_path)
    # The tokenizer's default mask token is known only later; any id inside the vocabulary builds the same modules.
    spec = make_spec(drafter_cfg, verifier_config, "check", verifier_path, default_mask_token_id=0)
    with torch.device("meta"):
        drafter_class(drafter_cfg.name)(spec)


def make_spec(
    drafter_cfg: DrafterConfig, verifier_config: Any, verifier_name: str, verifier_path: str, default_mask_token_id: int
) -> DrafterSpec:
    """The drafter's spec for a verifier. verifier_config: the checkpoint's HF config or its text config
    (load_verifier_config); a multimodal one is read through its text model, the architecture is the checkpoint's.
    Raises PipelineError for bad aux layer ids, a mask token outside the vocabulary or an unsupported family."""
    architecture = (verifier_config.architectures or [""])[0]
    verifier_config = verifier_config.get_text_config(decoder=True)
    num_layers = int(verifier_config.num_hidden_layers)
    aux = list(drafter_cfg.aux_layer_ids or default_aux_layer_ids(drafter_cfg.name, num_layers))
    check_aux_layer_ids(aux, num_layers)
    configured_mask = getattr(drafter_cfg, "mask_token_id", None)  # the drafters that fill positions with a mask token
    mask_token_id = configured_mask if configured_mask is not None else default_mask_token_id
    check_mask_token_id(mask_token_id, verifier_config.vocab_size)
    from pipeline.drafters import drafter_class

    cls = drafter_class(drafter_cfg.name)
    return DrafterSpec(
        algorithm=drafter_cfg.name,
        verifier_name=verifier_name,
        verifier_path=verifier_path,
        transformer_layer_config=cls.adapt_layer_config(_layer_config_dict(verifier_config)),
        aux_layer_ids=aux,
        num_speculative_tokens=int(drafter_cfg.num_speculative_tokens),
        mask_token_id=int(mask_token_id),
        num_layers=int(drafter_cfg.num_layers),
        # an EAGLE-family option; the block drafters' layers never read it
        norm_before_residual=bool(getattr(drafter_cfg, "norm_before_residual", True)),
        extra={key: getattr(drafter_cfg, key) for key in cls.extra_keys},
        verifier_architecture=architecture,
        verifier_logit_softcap=logit_softcap(verifier_config),
    )


def default_mask_token_id(tokenizer: Any) -> int:
    """A token that never appears in chat data: unk if the tokenizer has one, else pad."""
    for candidate in (tokenizer.unk_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    raise PipelineError("drafter.mask_token_id: the verifier's tokenizer has no unk/pad/eos token; set it")


def verifier_head_tensors(verifier_path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [V, H], lm_head [V, H]) read from the verifier's safetensors without loading the model (the text
    model's, for a multimodal verifier: pipeline/families.py). Raises PipelineError without weights or embedding."""
    found: dict[str, torch.Tensor] = {}
    files = sorted(Path(verifier_path).glob("*.safetensors"))
    if not files:
        raise PipelineError(f"verifier.path: no safetensors weights in '{verifier_path}'")
    embed_name = text_weights_prefix(verifier_config_dict(verifier_path)) + "embed_tokens.weight"
    wanted = {embed_name: "embed", "lm_head.weight": "lm_head"}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if key in wanted:
                    found[wanted[key]] = handle.get_tensor(key).float()
    if "embed" not in found:
        raise PipelineError(f"verifier.path: '{verifier_path}' has no {embed_name}")
    return found["embed"], found.get("lm_head", found["embed"])  # tied embeddings share one tensor


def build_drafter(spec: DrafterSpec,
                  verifier_tensors: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> DrafterBase:
    from pipeline.drafters import drafter_class

    model = drafter_class(spec.algorithm)(spec)
    embed, lm_head = verifier_tensors or verifier_head_tensors(spec.verifier_path)
    model.load_verifier_tensors(embed, lm_head)
    return model
