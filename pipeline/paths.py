"""Content-addressed stage folders: the same inputs always map to the same folder, so finished work is reused."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from pipeline.config.schema import (
    DataConfig,
    DeepSpeedConfig,
    DrafterConfig,
    EvalSetConfig,
    EvaluationConfig,
    GenerationConfig,
    PipelineConfig,
    TrainingConfig,
)
from pipeline.data.synthesize import WRITTEN_BY_THE_VERIFIER

if TYPE_CHECKING:
    from pipeline.config.schema import DataConfig, DrafterConfig, VerifierConfig


def _plain(value: Any) -> Any:
    if isinstance(value, DictConfig) or OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    return value


def content_key(*parts: Any) -> str:
    text = json.dumps([_plain(p) for p in parts], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def result_settings(values: Any, schema: type) -> dict:
    """values (a config group) without the settings its schema marks as not changing results (schema.NOT_A_RESULT),
    at every level of nested schema dataclasses; keys the schema does not declare (a plain dict's) are kept."""
    plain = _plain(values)
    hints = typing.get_type_hints(schema)
    for spec in dataclasses.fields(schema):
        if not spec.metadata.get("changes_results", True):
            plain.pop(spec.name, None)
        elif dataclasses.is_dataclass(hints[spec.name]) and isinstance(plain.get(spec.name), dict):
            plain[spec.name] = result_settings(plain[spec.name], hints[spec.name])
    return plain


def _schema_defaults(schema: type) -> dict:
    """A schema's result settings at their defaults, as result_settings gives a config's."""
    return result_settings(OmegaConf.structured(schema), schema)


@functools.lru_cache(maxsize=64)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    from pipeline.integrity import sha256_file

    return sha256_file(Path(path))


def prompt_file_digest(source: Any, path: Any, field: str = "data.path") -> str | None:
    """The sha256 of a local prompt file (data.path, or an eval set's path, for a jsonl or parquet source), so an
    edited file keys new prompts instead of reusing the old ones under its unchanged name. None for other sources
    and for a path that is not a file (the job refuses it by name before any stage: runner.check_input_files).
    Hashed once per file version a process sees (keyed by size and mtime). Raises PipelineError naming `field`
    for a file that cannot be read."""
    from pipeline.data.prompts import LOCAL_FILE_SOURCES
    from pipeline.errors import PipelineError

    if str(source) not in LOCAL_FILE_SOURCES or not path:
        return None
    file = Path(str(path)).expanduser()
    if not file.is_file():
        return None
    try:
        status = file.stat()
        return _file_sha256(str(file.resolve()), status.st_size, status.st_mtime_ns)
    except OSError as error:
        raise PipelineError(f"{field}: prompt file '{file}' cannot be read ({error.strerror or error})") from None


def local_path_identity(value: Any, always_local: bool = False) -> Any:
    """A path setting as its key holds it: a local file or folder by its resolved absolute path, so `dir`, `dir/`,
    `./dir`, `~/dir` and a symlink to it key one run (each spelling made a new folder and ran everything again).
    A setting that may name a hub id too (verifier.path) is resolved only while it names something here; one that
    is always local (`always_local`: training.resume_from) always, so its key stays once the folder is gone."""
    if not value:
        return value
    path = Path(str(value)).expanduser()
    return str(path.resolve()) if always_local or path.exists() else value


def _keyed_by_content(settings: dict, source: Any, field: str) -> dict:
    """settings with a local prompt file keyed by its bytes instead of where it lies: the same file on a laptop
    and on a cluster's shared mount selects the same prompts, an edited one new prompts."""
    digest = prompt_file_digest(source, settings.get("path"), field)
    if digest:
        settings = {**settings, "path": None, "path_sha256": digest}
    return settings


def _used_data_settings(data_cfg: DataConfig) -> dict:
    """cfg.data's result settings (not its `name` label), with the fields its source does not read
    (pipeline/data/prompts.py: FIELDS_READ_BY) at their defaults: another value of one selects the same prompts, so
    it resumes the same run. The synthetic settings of a source that does not read them are left out instead (as
    before the other fields were normalised: those keys stay)."""
    from pipeline.data.prompts import FIELDS_READ_BY  # imports datasets: only when keys are built

    data = result_settings(data_cfg, DataConfig)
    for name, sources in FIELDS_READ_BY.items():
        if data.get("source") in sources:
            continue
        if name == "synthetic":
            data.pop(name, None)
        else:
            data[name] = getattr(DataConfig, name)  # a plain default (only `synthetic` has a factory)
    return _keyed_by_content(data, data.get("source"), "data.path")  # other sources' keys stay as they were


def _used_set_fields(definition: Any, set_name: str) -> Any:
    """An eval set's definition (a plain dict of EvalSetConfig fields, as written) without the fields its source does
    not read: another value of one decodes the same prompts. The presets write none, so their keys stay."""
    from pipeline.data.prompts import FIELDS_READ_BY

    if not isinstance(definition, dict):  # refused when the set is read (eval_sets.set_config), named there
        return definition
    source = str(definition.get("source", EvalSetConfig.source))
    used = {name: value for name, value in definition.items()
            if name not in FIELDS_READ_BY or source in FIELDS_READ_BY[name]}
    return _keyed_by_content(used, source, f"evaluation.sets.{set_name}.path")


def _deepspeed_settings(cfg: PipelineConfig) -> dict:
    """cfg.deepspeed's result settings; with DeepSpeed off only `enabled` is read (the plain torch engine), so the
    rest are keyed at their defaults and changing them resumes the same run."""
    deepspeed = result_settings(cfg.deepspeed, DeepSpeedConfig)
    if not cfg.deepspeed.enabled:
        deepspeed = {**_schema_defaults(DeepSpeedConfig), "enabled": False}
    return deepspeed


def chat_additions(verifier_cfg: VerifierConfig) -> dict:
    """What a GGUF conversion adds to the file's own (a chat template, end-of-turn ids): part of the verifier's
    identity. Empty for most verifiers."""
    additions = {"chat_template": verifier_cfg.chat_template,
                 "end_of_turn_tokens": list(verifier_cfg.end_of_turn_tokens)}
    return {key: value for key, value in additions.items() if value}


def _selects_by_val_tau(cfg: PipelineConfig) -> bool:
    # validate() refuses val.tau selection without val_tau_samples; the second test keeps keys right without it.
    return cfg.training.select_best_by == "val.tau" and cfg.training.val_tau_samples > 0


def _val_tau_decoding(cfg: PipelineConfig) -> list[dict]:
    """How val.tau decodes when it picks the final checkpoint (training.select_best_by=val.tau): the evaluation's K,
    batch and the drafter's decoding options change val.tau and so the checkpoint picked. [] otherwise: val.tau is
    then only logged, and the training's key is as without it."""
    if not _selects_by_val_tau(cfg):
        return []
    return [{"val_tau_decoding": {"num_speculative_tokens": cfg.evaluation.num_speculative_tokens,
                                  "batch_size": cfg.evaluation.batch_size, **decoding_options(cfg.drafter)}}]


def decoding_options(drafter_cfg: DrafterConfig) -> dict[str, Any]:
    """{name: value} of the drafter's options that decode and never train (schema.decoding_setting: DSpark's
    confidence_threshold); {} for a drafter without any. drafter_cfg: the composed `drafter` group."""
    schema = _drafter_schema(drafter_cfg)
    return {spec.name: _plain(getattr(drafter_cfg, spec.name)) for spec in dataclasses.fields(schema)
            if spec.metadata.get("decoding")}


def _drafter_schema(drafter_cfg: DrafterConfig) -> type:
    """The drafter's own schema class (pipeline/drafters/<name>/config.py), DrafterConfig for an untyped group."""
    schema = OmegaConf.get_type(drafter_cfg)
    return schema if isinstance(schema, type) and issubclass(schema, DrafterConfig) else DrafterConfig


def _auto_precision(cfg: PipelineConfig) -> str:
    """What training.autocast_dtype=auto trains in (pipeline/training/precision.py: resolve_autocast): on a GPU
    cluster whatever its workers' GPUs compute natively (bf16 from Ampere on; the driver has no GPU to ask, so the
    key says "gpu"), and on CPU what this host computes natively (AVX512-BF16/AMX: bf16, else fp32), as a local
    Ray's workers do. Without it one key would hold an fp32 run on one machine and a bf16 run on another."""
    if cfg.cluster.use_gpu:
        return "gpu"
    from pipeline.training.precision import native_bf16  # imports torch: only when keys are built

    return "bf16" if native_bf16("cpu") else "fp32"


def _training_settings(cfg: PipelineConfig) -> dict:
    """cfg.training's result settings, with autocast `auto` as the precision it resolves to here; how val.tau
    decodes counts only when val.tau picks the final checkpoint (otherwise it is only logged: training draws its
    anchors and order from its own seeded generators). Settings the run's optimizer does not read (Muon's under
    AdamW, grad_clip under DeepSpeed's Muon) are keyed at their defaults: another value resumes the same run."""
    training = result_settings(cfg.training, TrainingConfig)
    training["resume_from"] = local_path_identity(training.get("resume_from"), always_local=True)
    if training.get("autocast_dtype") == "auto":
        training["autocast_dtype"] = f"auto:{_auto_precision(cfg)}"
    if not _selects_by_val_tau(cfg):
        training.pop("val_tau_samples", None)
        training.pop("val_tau_max_new_tokens", None)
    if cfg.training.val_samples == 0:  # no validation, so no pick among checkpoints: the last step's weights are final
        training["checkpoint_every"] = TrainingConfig.checkpoint_every
    if cfg.training.optimizer != "muon":  # AdamW alone: nothing reads Muon's settings
        for name in ("muon_lr", "muon_momentum", "muon_weight_decay"):
            training[name] = getattr(TrainingConfig, name)
    elif cfg.deepspeed.enabled:  # DeepSpeed's Muon steps unclipped (pipeline/training/optim.py: deepspeed_grad_clip)
        training["grad_clip"] = TrainingConfig.grad_clip
    return training


class StagePaths:
    """Where each stage of a config writes. Keys chain: a stage's key includes the keys of what it reads."""

    def __init__(self, cfg: PipelineConfig):
        self.root = Path(cfg.paths.root).expanduser().resolve()
        verifier = {k: getattr(cfg.verifier, k) for k in ("name", "path", "gguf_package", "gguf_file", "save_dtype")}
        verifier["path"] = local_path_identity(verifier["path"])
        verifier.update(chat_additions(cfg.verifier))  # only when set: SmolLM2's keys stay as they were
        if cfg.verifier.tiny:  # likewise: a tiny family verifier is named by its family and build
            from pipeline.generation.tiny_verifier import build_name

            verifier["tiny"] = build_name(cfg.verifier.tiny)
        self.verifier_identity = verifier
        # split-v2: the held-out prompts are taken before the train prompts (a folder of the old split is not reused).
        # Prompts the verifier writes itself depend on the verifier too.
        data = _used_data_settings(cfg.data)
        writer = [verifier, cfg.verifier.compute_dtype] if cfg.data.source in WRITTEN_BY_THE_VERIFIER else []
        self.prompts_key = content_key(data, "split-v2", *writer)
        # what the prompts stage checks the file it reads against: the bytes this key was made of
        self.prompt_file_sha256: str | None = data.get("path_sha256")
        gen = cfg.generation
        regeneration = result_settings(gen, GenerationConfig)
        if gen.temperature > 0:
            # Sampling draws one random stream per batch (pipeline/generation/workers.py: batch_seed): which answers
            # share a batch changes what is sampled, so the batching settings count too.
            regeneration.update(batch_size=gen.batch_size, max_batch_tokens=gen.max_batch_tokens)
        compression = regeneration.pop("compression")  # how the store keeps hidden states: the store's key, below
        self.regenerated_key = content_key(self.prompts_key, verifier, regeneration, cfg.verifier.compute_dtype)
        # Explicit aux layers change what is captured; null means "every drafter's defaults", shared by all drafters.
        # The capture backend is not in the key: hf and vllm capture the same states (tested within bf16).
        # [] and null both mean the defaults.
        aux_layer_ids = list(cfg.drafter.aux_layer_ids or []) or None
        self.store_key = content_key(self.regenerated_key, "store-v3", aux_layer_ids, compression)
        # Logging, retries and labels stay out (schema.NOT_A_RESULT): changing them resumes the same run.
        # The drafter's options are its own schema's (pipeline/drafters/<name>/config.py).
        # Its decoding options (schema.DECODING) key the evaluation, and the training only through val.tau.
        decoding = decoding_options(cfg.drafter)
        drafter = {name: value for name, value in result_settings(cfg.drafter, _drafter_schema(cfg.drafter)).items()
                   if name not in decoding}
        drafter["aux_layer_ids"] = aux_layer_ids
        self.train_key = content_key(self.store_key, drafter, _training_settings(cfg), _deepspeed_settings(cfg),
                                     *_val_tau_decoding(cfg))
        # One report per (checkpoint, evaluation settings): another K or threshold never overwrites a report.
        measured = result_settings(cfg.evaluation, EvaluationConfig)
        if decoding:
            measured["decoding"] = decoding
        # Only the eval sets it decodes: another preset added to evaluation.sets changes no report.
        measured["sets"] = {name: _used_set_fields(measured["sets"][name], name) for name in cfg.evaluation.datasets
                            if name in measured["sets"]}
        # sets-v2: a named set leaves out the training split's prompts by their user turns (eval_sets.trained_prompts),
        # not by whole conversation: a report measured on the old sets may hold trained prompts and is not reused.
        self.evaluation_key = content_key(self.train_key, measured, data, "sets-v2")
        # what the evaluate stage checks each eval set's local file against (as prompt_file_sha256)
        self.eval_set_sha256: dict[str, str] = {name: definition["path_sha256"]
                                                for name, definition in measured["sets"].items()
                                                if isinstance(definition, dict) and definition.get("path_sha256")}

    def stage_key(self, stage: str) -> str:
        """The key of the folder `stage` writes: the one a lock on that stage guards (pipeline/locks.py)."""
        keys = {"prompts": self.prompts_key, "regenerate": self.regenerated_key, "capture": self.store_key,
                "train": self.train_key}
        return keys.get(stage, self.evaluation_key)  # evaluate, export, vllm_eval, promote: one evaluation's

    @property
    def prompts(self) -> Path:
        return self.root / "prompts" / self.prompts_key

    @property
    def regenerated(self) -> Path:
        return self.root / "regenerated" / self.regenerated_key

    @property
    def regenerated_parts(self) -> Path:
        """Finished regeneration batches of an interrupted run, until the whole set is saved."""
        return self.root / "regenerated" / f"{self.regenerated_key}.parts"

    @property
    def store(self) -> Path:
        return self.root / "stores" / self.store_key

    @property
    def train(self) -> Path:
        return self.root / "train" / self.train_key

    @property
    def final_checkpoint(self) -> Path:
        return self.train / "final"

    @property
    def evaluation(self) -> Path:
        return self.root / "eval" / self.evaluation_key

    @property
    def export(self) -> Path:
        """One export per evaluation, as its model card and decoding options (DSpark's threshold) are that
        evaluation's: another K or threshold on the same checkpoint never overwrites it."""
        return self.root / "export" / self.evaluation_key
