"""The speculators checkpoint format (what vLLM loads as-is): config.json + model.safetensors.

EAGLE-3 / P-EAGLE checkpoints carry the token embedding (the verifier's, or the drafter's own when
drafter.embed_requires_grad trained it): speculators' loaders read it from the checkpoint, and vLLM serves a
drafter's own embedding when it differs from the target's. DFlash / DSpark checkpoints have none; vLLM shares the
target's. The LM head is written so the speculators library can load the checkpoint on its own.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pipeline.drafters.common import DrafterSpec
from pipeline.drafters.vocab import ids_from_d2t
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_folder

SPECULATORS_VERSION = "0.9.0"
EXPORT_DTYPE = torch.bfloat16
ARCHITECTURES = {"eagle3": "Eagle3Speculator", "peagle": "PEagleSpeculator", "dflash": "DFlashDraftModel",
                 "dspark": "DSparkDraftModel"}
EAGLE_FAMILY, BLOCK_FAMILY = ("eagle3", "peagle"), ("dflash", "dspark")
# speculators' EAGLE-3/P-EAGLE loaders take the embedding from the checkpoint (a missing one stays zeros), so the
# EAGLE family ships it; its DFlash/DSpark loaders always copy the verifier's. vLLM accepts both.
NOT_EXPORTED = {"eagle3": (), "peagle": (), "dflash": ("embed_tokens.weight",), "dspark": ("embed_tokens.weight",)}
# speculators saves a full-vocabulary block drafter without its LM head (frozen: the verifier's own); loading such a
# checkpoint keeps the head build_drafter took from the verifier, as vLLM shares the target's head when a drafter
# checkpoint has none (llm_base_proposer._maybe_share_lm_head).
VERIFIER_HEAD_WHEN_ABSENT = {"eagle3": (), "peagle": (), "dflash": ("lm_head.weight",), "dspark": ("lm_head.weight",)}


def speculators_config(spec: DrafterSpec, dtype: torch.dtype = EXPORT_DTYPE) -> dict[str, Any]:
    layer_config = dict(spec.transformer_layer_config, num_hidden_layers=spec.num_layers)
    config = {
        "architectures": [ARCHITECTURES[spec.algorithm]],
        "speculators_model_type": spec.algorithm,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": spec.algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": spec.num_speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": spec.verifier_path,
                         "architectures": [_verifier_architecture(spec)]},
        },
        "transformer_layer_config": layer_config,
        "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": spec.hidden_size,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    config.update(_eagle_fields(spec) if spec.algorithm in EAGLE_FAMILY else _block_fields(spec))
    return config


def _eagle_fields(spec: DrafterSpec) -> dict[str, Any]:
    fields = {
        "eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
        # vLLM assumes True when absent, speculators False: always write it.
        "norm_before_residual": spec.norm_before_residual,
        "norm_before_fc": bool(spec.extra.get("norm_before_fc", False)),
        "fc_norm": False,
        # vLLM's P-EAGLE drafts without chaining hidden states, so only EAGLE-3 has a norm_output.
        "norm_output": bool(spec.extra.get("norm_output", False)),
        # speculators' own key: whether training moved the embedding this checkpoint carries.
        "embed_requires_grad": bool(spec.extra.get("embed_requires_grad", False)),
    }
    if spec.algorithm == "peagle":
        fields["mask_token_id"] = spec.mask_token_id
    return fields


def _block_fields(spec: DrafterSpec) -> dict[str, Any]:
    from pipeline.drafters import drafter_class

    cls = drafter_class(spec.algorithm)
    fields = {
        "aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
        "block_size": cls.block_size_for(spec.num_speculative_tokens, cls.sample_from_anchor),
        "mask_token_id": spec.mask_token_id,
        "sample_from_anchor": cls.sample_from_anchor,
        # vLLM reads this flag as "the block is bidirectional" for every layer (speculators only for sliding-window
        # layers; its full-attention layers are always bidirectional), so write the block's true shape.
        "sliding_window_non_causal": not spec.extra.get("causal_block", False),
    }
    if spec.algorithm == "dspark":
        fields.update({"markov_rank": int(spec.extra["markov_rank"]), "markov_head_type": "vanilla",
                       "enable_confidence_head": True, "confidence_head_with_markov": True})
        if "confidence_threshold" in spec.extra:  # ours: the evaluated truncation threshold (others ignore it)
            fields["confidence_threshold"] = float(spec.extra["confidence_threshold"])
    return fields


def _verifier_architecture(spec: DrafterSpec) -> str:
    """The verifier's HF architecture; a spec saved before it was recorded had a verifier of its layer's type."""
    if spec.verifier_architecture:
        return spec.verifier_architecture
    return {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[spec.transformer_layer_config["model_type"]]


def round_to_export_dtype(model: torch.nn.Module) -> torch.nn.Module:
    """Round the weights in place as the export stores them, so evaluation measures the served drafter."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(EXPORT_DTYPE))
    return model


def export_speculators(model: torch.nn.Module, target: Path, dtype: torch.dtype = EXPORT_DTYPE) -> Path:
    """Write the checkpoint into a temporary sibling folder and rename it into place when complete."""
    spec: DrafterSpec = model.spec
    if spec.algorithm not in ARCHITECTURES:
        raise PipelineError(f"export: no speculators layout for drafter '{spec.algorithm}'")
    if spec.algorithm == "peagle" and "mask_hidden" not in model.state_dict():
        raise PipelineError("export: a P-EAGLE checkpoint needs mask_hidden (vLLM refuses to load without it)")
    tensors = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous()
               for k, v in model.state_dict().items() if k not in NOT_EXPORTED[spec.algorithm]}
    with atomic_folder(target) as staging:
        (staging / "config.json").write_text(json.dumps(speculators_config(spec, dtype), indent=2))
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    return target


def export_digest(folder: Path, exclude: tuple[str, ...] = ("README.md", "integrity-rank0.json")) -> str:
    """sha256 (hex) over every file of an export folder but `exclude` (paths relative to it): each file's relative
    path, size and bytes, in path order, so the same weights and config always give the same digest. The model
    card (README.md) is left out: it names the registered version and the run that made it, which the digest
    must not depend on; so is the integrity record written after the card. Raises OSError when a file cannot be read."""
    digest = hashlib.sha256()
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
    for path in files:
        relative = path.relative_to(folder).as_posix()
        if relative in exclude:
            continue
        digest.update(f"{relative}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def spec_from_speculators(config: dict[str, Any], weights: dict[str, torch.Tensor],
                          verifier_path: str | None = None) -> DrafterSpec:
    for key in ("speculators_model_type", "transformer_layer_config", "speculators_config"):
        if key not in config:
            raise PipelineError(f"checkpoint config.json: missing '{key}'")
    algorithm = config["speculators_model_type"]
    if algorithm not in ARCHITECTURES:
        raise PipelineError(f"checkpoint config.json: speculators_model_type '{algorithm}' is not one of "
                            f"{sorted(ARCHITECTURES)}")
    layer_config = dict(config["transformer_layer_config"])
    num_layers = int(layer_config.get("num_hidden_layers", 1))
    verifier = config["speculators_config"]["verifier"]["name_or_path"]
    aux_key = "eagle_aux_hidden_state_layer_ids" if algorithm in EAGLE_FAMILY else "aux_hidden_state_layer_ids"
    extra = {}
    if algorithm in EAGLE_FAMILY:
        if config.get("fc_norm"):
            raise PipelineError("checkpoint config.json: fc_norm (one RMSNorm per aux layer) is not supported; "
                                "norm_before_fc is")
        extra["norm_before_fc"] = bool(config.get("norm_before_fc", False))
        extra["embed_requires_grad"] = bool(config.get("embed_requires_grad", False))
    if algorithm == "eagle3":
        extra["norm_output"] = bool(config.get("norm_output", False))
    if algorithm in BLOCK_FAMILY:
        extra["causal_block"] = not config.get("sliding_window_non_causal", True)
    if algorithm == "dspark":
        extra["markov_rank"] = int(config["markov_rank"])
        if "confidence_threshold" in config:
            extra["confidence_threshold"] = float(config["confidence_threshold"])
    return DrafterSpec(
        algorithm=algorithm,
        verifier_name=verifier,
        verifier_path=verifier_path or verifier,
        transformer_layer_config=layer_config,
        aux_layer_ids=list(config[aux_key]),
        num_speculative_tokens=int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]),
        mask_token_id=int(config.get("mask_token_id") or 0),
        num_layers=num_layers,
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        draft_token_ids=ids_from_d2t(weights["d2t"]) if "d2t" in weights else None,
        extra=extra,
        verifier_architecture=(config["speculators_config"]["verifier"].get("architectures") or [""])[0],
    )


def load_speculators(folder: Path, verifier_path: str | None = None):
    """Rebuild our drafter from a speculators checkpoint, ours or theirs (embeddings, and a block drafter's frozen
    LM head when the checkpoint has none, from the verifier). Raises PipelineError for a checkpoint whose tensors
    are not the drafter's."""
    from pipeline.drafters.build import build_drafter

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    weights = {k: v.float() if v.is_floating_point() else v for k, v in
               load_file(str(folder / "model.safetensors")).items()}
    spec = spec_from_speculators(config, weights, verifier_path)
    model = build_drafter(spec)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    from_verifier = NOT_EXPORTED[spec.algorithm]
    if spec.draft_token_ids is None:  # a pruned head is always saved (speculators' rule): its absence is a fault
        from_verifier += VERIFIER_HEAD_WHEN_ABSENT[spec.algorithm]
    if [k for k in missing if k not in from_verifier] or unexpected:
        raise PipelineError(f"checkpoint: '{folder}' does not match {spec.algorithm}: missing {missing}, "
                            f"unexpected {unexpected}")
    return model.eval()
