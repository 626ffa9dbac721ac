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
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file, save_file

from pipeline.drafters.base import DrafterBase
from pipeline.drafters.spec import DrafterSpec
from pipeline.drafters.vocab import ids_from_d2t
from pipeline.errors import PipelineError, read_json
from pipeline.fsutil import atomic_folder

SPECULATORS_VERSION = "0.9.0"
EXPORT_DTYPE = torch.bfloat16
ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


def _drafter(algorithm: str, where: str):
    """The drafter class of `algorithm` (its export facts: architecture, fields, tensors left out); raises
    PipelineError naming `where` for an algorithm with no speculators layout here."""
    from pipeline.drafters import DRAFTERS

    if algorithm not in DRAFTERS:
        raise PipelineError(f"{where}: speculators_model_type '{algorithm}' is not one of {sorted(DRAFTERS)}")
    return DRAFTERS[algorithm]


def speculators_config(spec: DrafterSpec, dtype: torch.dtype = EXPORT_DTYPE) -> dict[str, Any]:
    """config.json of the checkpoint: the keys every speculators checkpoint has, then the drafter's own
    (its class's export_fields). Raises PipelineError for an algorithm with no speculators layout."""
    drafter = _drafter(spec.algorithm, "export")
    layer_config = dict(spec.transformer_layer_config, num_hidden_layers=spec.num_layers)
    config = {
        "architectures": [drafter.speculators_architecture],
        "speculators_model_type": spec.algorithm,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": spec.algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": spec.num_speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": spec.verifier_path,
                         "architectures": _verifier_architectures(spec)},
        },
        "transformer_layer_config": layer_config,
        "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": spec.hidden_size,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    config.update(drafter.export_fields(spec))
    return config


def _verifier_architectures(spec: DrafterSpec) -> list[str]:
    """The verifier's HF architecture, as a one-item list. A spec saved before it was recorded takes it from the
    verifier folder's config.json; where that is no local folder, the list is empty (vLLM does not read it, and
    serving then skips the architecture check) rather than a guess from the drafter's layer type, which would
    refuse the true verifier of a MoE or multimodal family."""
    if spec.verifier_architecture:
        return [spec.verifier_architecture]
    config_file = Path(spec.verifier_path) / "config.json"
    if config_file.is_file():
        verifier_config = read_json(config_file, "verifier.path")
        architectures = verifier_config.get("architectures") if isinstance(verifier_config, dict) else None
        if isinstance(architectures, list) and architectures and isinstance(architectures[0], str):
            return architectures[:1]
    return []


def round_to_export_dtype(model: ModuleT) -> ModuleT:
    """Round the weights in place as the export stores them, so evaluation measures the served drafter."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(EXPORT_DTYPE))
    return model


def export_speculators(model: DrafterBase, target: Path, dtype: torch.dtype = EXPORT_DTYPE) -> Path:
    """Write the checkpoint into a temporary sibling folder and rename it into place when complete."""
    spec: DrafterSpec = model.spec
    drafter = _drafter(spec.algorithm, "export")
    model.check_exportable()
    tensors = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous()
               for k, v in model.state_dict().items() if k not in drafter.not_exported}
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


def exported_k(config: dict[str, Any]) -> Any:
    """The K a speculators config.json records its drafter was trained for, as written
    (speculators_config.proposal_methods[0].speculative_tokens, speculators' own place for it); None where the
    config has no such field. The caller checks that it is a whole number."""
    speculators = config.get("speculators_config")
    methods = speculators.get("proposal_methods") if isinstance(speculators, dict) else None
    if not isinstance(methods, list) or not methods or not isinstance(methods[0], dict):
        return None
    return methods[0].get("speculative_tokens")


def spec_from_speculators(config: dict[str, Any], weights: dict[str, torch.Tensor],
                          verifier_path: str | None = None) -> DrafterSpec:
    for key in ("speculators_model_type", "transformer_layer_config", "speculators_config"):
        if key not in config:
            raise PipelineError(f"checkpoint config.json: missing '{key}'")
    algorithm = config["speculators_model_type"]
    drafter = _drafter(algorithm, "checkpoint config.json")
    layer_config = dict(config["transformer_layer_config"])
    num_layers = int(layer_config.get("num_hidden_layers", 1))
    verifier = config["speculators_config"]["verifier"]["name_or_path"]
    extra = drafter.extra_from_export(config)
    k = exported_k(config)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise PipelineError(f"checkpoint config.json: speculators_config.proposal_methods[0].speculative_tokens "
                            f"is {k!r}, not a K (a whole number >= 1)")
    return DrafterSpec(
        algorithm=algorithm,
        verifier_name=verifier,
        verifier_path=verifier_path or verifier,
        transformer_layer_config=layer_config,
        aux_layer_ids=list(config[drafter.aux_layers_key]),
        num_speculative_tokens=k,
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
    config = read_json(folder / "config.json", "export")
    weights = {k: v.float() if v.is_floating_point() else v for k, v in
               load_file(str(folder / "model.safetensors")).items()}
    spec = spec_from_speculators(config, weights, verifier_path)
    model = build_drafter(spec)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    from_verifier = type(model).not_exported
    if spec.draft_token_ids is None:  # a pruned head is always saved (speculators' rule): its absence is a fault
        from_verifier += type(model).verifier_head_when_absent
    if [k for k in missing if k not in from_verifier] or unexpected:
        raise PipelineError(f"checkpoint: '{folder}' does not match {spec.algorithm}: missing {missing}, "
                            f"unexpected {unexpected}")
    return model.eval()
