"""Semantic checks the schema's types cannot express. Each error names the config field."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Iterator, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from pipeline.config import schema as schema_module
from pipeline.config.registration import check_boolean_overrides
from pipeline.data.prompts import OFFLINE_SOURCES
from pipeline.data.synthesize import WRITTEN_BY_THE_VERIFIER, check_synthetic_config
from pipeline.errors import PipelineError, first_line
from pipeline.errors import require as _require
from pipeline.fsutil import is_remote
from pipeline.generation.regenerate import MIN_RESPONSE_ROOM


def _check_known_keys(node: Any, schema: type, prefix: str) -> None:
    """Keys forced in with `+key=value` bypass OmegaConf's struct check; catch them here by name. A group composed
    from a subclass of its declared schema (a drafter's own options) is checked against that subclass."""
    node_type = OmegaConf.get_type(node)
    if isinstance(node_type, type) and dataclasses.is_dataclass(node_type) and issubclass(node_type, schema):
        schema = node_type
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node.keys():
        if key not in fields:
            raise PipelineError(f"{prefix}{key}: unknown config key (not in {schema.__name__})")
        child_schema = fields[key].type
        if isinstance(child_schema, str):
            child_schema = getattr(schema_module, child_schema, None)
        if isinstance(child_schema, type) and dataclasses.is_dataclass(child_schema):
            _check_known_keys(node[key], child_schema, f"{prefix}{key}.")


def _check_nothing_missing(cfg: DictConfig) -> None:
    """A value the schema leaves unset (`???`) is refused by name before anything reads it: a group removed with
    `~group` or composed from a bare schema leaves its mandatory `name` unset."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if not missing:
        return
    if re.fullmatch(r"\w+\.name", missing[0]):  # a group's label: the group itself was removed
        group = missing[0].split(".")[0]
        raise PipelineError(f"{missing[0]}: not set (choose one with {group}=<option>; `~{group}` removes the group)")
    raise PipelineError(f"{missing[0]}: not set (??? is a value to fill in)")


# Passed through as written to DeepSpeed, vLLM, Ray Serve or Ray Train, whose own schemas judge them (vLLM and Ray
# Train's FailureConfig take -1 for "no limit"; serving.autoscaling is checked by Ray Serve's model below), or
# checked against the verifier's config before any stage (pipeline/drafters/build.py: check_configured_drafter,
# naming the verifier's range).
UNCHECKED_NUMBERS = ("deepspeed.extra", "serving.engine_kwargs", "serving.autoscaling", "training.max_failures",
                     "drafter.mask_token_id", "drafter.aux_layer_ids")


def _leaves(value: Any, name: str = "", skip: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """(dotted field name, value) of every scalar in a resolved config: groups, nested settings, lists (`x[i]`) and
    plain dicts, leaving out the fields named in `skip` and everything under them."""
    if name in skip:
        return
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _leaves(child, f"{name}.{key}" if name else str(key), skip)
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _leaves(child, f"{name}[{index}]", skip)
    else:
        yield name, value


MAX_SEED = 2**32 - 1  # a seed every generator the pipeline seeds accepts (numpy's legacy one takes 32 bits)
MAX_INT = 2**63 - 1  # int64


def _check_numbers(resolved: dict) -> None:
    """Every number in the config counts, sizes, rates, seeds, ports or weights something: none is negative, NaN or
    infinite (a NaN slips through every `x <= 0` check). Walks the resolved config's groups, nested settings, lists
    and plain dicts (`${oc.env:SEED}` as it resolves). Raises PipelineError naming the first such field."""
    import math

    for name, value in _leaves(resolved, skip=UNCHECKED_NUMBERS):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            _require(math.isfinite(value) and value >= 0, f"{name}: must be a finite number >= 0, got {value}")
        if isinstance(value, int) and not isinstance(value, bool):
            # torch's and numpy's generators take seeds of 32 (numpy's legacy) to 64 bits, tensors int64 sizes:
            # a larger whole number overflowed deep inside a Ray worker, after the stages before it had run
            limit = MAX_SEED if name.rsplit(".", 1)[-1].endswith("seed") else MAX_INT
            _require(value <= limit, f"{name}: must be at most {limit}, got {value}")


def _resolved(cfg: DictConfig) -> dict:
    """The config as plain containers with every interpolation resolved; one that cannot be (`${oc.env:UNSET}`) is
    refused naming its field."""
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as error:
        raise PipelineError(f"{error.full_key}: {first_line(error)}") from None
    assert isinstance(resolved, dict)  # a DictConfig resolves to a dict
    return resolved


def _command_line_overrides() -> list[str]:
    """The overrides of the @hydra.main job running now ([] outside one: pipeline.config.compose checks its own)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def validate(config: schema_module.PipelineConfig | DictConfig) -> None:
    """Raises PipelineError naming the first field whose value no stage can use. `config`: the composed config (a
    DictConfig, however it is typed), read here as the DictConfig it is: unknown keys, missing values and
    interpolations are the container's."""
    from pipeline.drafters import DRAFTERS

    cfg = cast(DictConfig, config)
    _check_known_keys(cfg, schema_module.PipelineConfig, "")
    check_boolean_overrides(cfg, _command_line_overrides())
    resolved = _resolved(cfg)  # an interpolation that cannot resolve is named before any check reads its field
    _check_nothing_missing(cfg)

    _validate_output_paths(cfg)
    _require_path(cfg.data, "data")
    if cfg.data.source in WRITTEN_BY_THE_VERIFIER:
        check_synthetic_config(cfg.data.synthetic, "data.synthetic")
    _require(cfg.data.num_train > 0, "data.num_train: must be > 0")
    _require(cfg.data.num_eval >= 1, "data.num_eval: must be >= 1 (the held-out prompts the evaluation uses)")
    gen = cfg.generation
    _require(gen.temperature >= 0, "generation.temperature: must be >= 0")
    _require(0 < gen.top_p <= 1, "generation.top_p: must be in (0, 1]")
    for key in ("max_batch_tokens", "batch_size"):
        _require(gen[key] > 0, f"generation.{key}: must be > 0")
    for key in ("capture_max_batch_tokens", "capture_batch_size", "kv_cache_gb"):
        _require(gen[key] is None or gen[key] > 0, f"generation.{key}: must be > 0 (or null)")
    _require(gen.max_store_gb > 0, "generation.max_store_gb: must be > 0")
    _require(gen.num_actors >= 1, "generation.num_actors: must be >= 1")
    # fewer would skip every sample as leaving no room for an answer, and name generation.max_length for it
    _require(gen.responses == "keep" or gen.max_new_tokens >= MIN_RESPONSE_ROOM,
             f"generation.max_new_tokens: must be >= {MIN_RESPONSE_ROOM} (the least room a regenerated answer gets)")
    _require(cfg.generation.max_length > 8, "generation.max_length: must be > 8")
    _validate_drafter(cfg.drafter, DRAFTERS)
    _require(cfg.evaluation.temperature >= 0, "evaluation.temperature: must be >= 0 (0 = greedy)")
    _validate_evaluation(cfg.evaluation)
    _validate_no_credentials(resolved)
    _validate_registry_names(cfg)
    _validate_serving(cfg.serving)
    _validate_generation_parallelism(cfg.generation)
    _validate_cluster_shape(cfg)
    _require(cfg.training.num_workers >= 1, "training.num_workers: must be >= 1")
    _require(cfg.training.max_steps >= 1, "training.max_steps: must be >= 1")
    _require(cfg.training.val_samples >= 0, "training.val_samples: must be >= 0")
    _validate_val_tau(cfg.training)
    _validate_optimizer(cfg.training)
    _validate_training_cadence(cfg.training)
    _require(cfg.training.max_tokens_per_micro_batch >= 0,
             "training.max_tokens_per_micro_batch: must be >= 0 (0 = no packing)")
    _require(cfg.training.prefetch_micro_batches >= 1, "training.prefetch_micro_batches: must be >= 1")
    _require(cfg.training.max_failures >= -1, "training.max_failures: must be >= 0, or -1 for no limit")
    _require(cfg.training.torch_threads_per_worker >= 1, "training.torch_threads_per_worker: must be >= 1")
    _require(cfg.deepspeed.zero_stage in (0, 1, 2, 3), "deepspeed.zero_stage: must be 0, 1, 2 or 3")
    _require(not cfg.deepspeed.offload_params or cfg.deepspeed.zero_stage == 3,
             "deepspeed.offload_params: parameters are offloaded only by ZeRO stage 3")
    _require("optimizer" not in (cfg.deepspeed.extra or {}),
             "deepspeed.extra.optimizer: the optimizer is training.optimizer's (adamw or muon), handed to DeepSpeed "
             "with its parameter split; remove the block")
    # K draft tokens after an anchor must fit in a training sample: a K past the longest one trains no token at its
    # last depths (and K=100000 would only fail on memory when the drafter is built)
    _require(cfg.drafter.num_speculative_tokens < cfg.generation.max_length,
             f"drafter.num_speculative_tokens: {cfg.drafter.num_speculative_tokens} must be below "
             f"generation.max_length={cfg.generation.max_length} (no sample has room to train its last drafts)")
    _require(
        1 <= cfg.evaluation.num_speculative_tokens <= cfg.drafter.num_speculative_tokens,
        "evaluation.num_speculative_tokens: must be between 1 and drafter.num_speculative_tokens",
    )
    _require(not cfg.verifier.get("tiny") or not (cfg.verifier.path or cfg.verifier.gguf_package),
             "verifier.tiny: builds its own verifier; leave verifier.path and verifier.gguf_package unset")
    _require(len(cfg.stages) >= 1, f"stages: name at least one stage of {schema_module.STAGE_NAMES}")
    # each stage reads what the ones before it in this order make: [train, prompts] failed in train after the store
    named = [str(stage) for stage in cfg.stages]
    order = [schema_module.STAGE_NAMES.index(stage) for stage in named]
    _require(order == sorted(set(order)), f"stages: {named} must name each stage once, in the order "
                                          f"{list(schema_module.STAGE_NAMES)}")
    _check_numbers(resolved)  # last: a field's own check above says more (its range, what 0 means)


def _validate_drafter(drafter: DictConfig, drafters: dict) -> None:
    """The drafter's options are those of its own schema (`drafter=<name>` composes it; another drafter's option
    is refused by name there or in _check_known_keys); each schema checks its values (its `validate`)."""
    _require(drafter.name in drafters, f"drafter.name: '{drafter.name}' is not one of {sorted(drafters)}")
    schema = drafters[drafter.name].config_class
    _require(OmegaConf.get_type(drafter) is schema,
             f"drafter.name: '{drafter.name}' needs its own options ({schema.__name__}): choose it with "
             f"drafter={drafter.name}, not drafter.name={drafter.name}")
    options = OmegaConf.to_object(drafter)
    assert isinstance(options, schema)  # the type check above: its own structured schema
    options.validate()


# Where the pipeline writes: folders it makes, and the one file it writes outside a stage folder.
OUTPUT_FOLDERS = ("paths.root", "paths.cache", "verifier.cache_dir", "cluster.storage_path")
OUTPUT_FILES = ("serving.serve_config_path",)


def _validate_output_paths(cfg: DictConfig) -> None:
    """A folder the pipeline writes into that is a file (or lies under one), or the file it writes that is a
    folder, fails only when a stage first writes there, as an OSError; an empty paths.root would write at the
    filesystem's root and the working folder."""
    _require(str(cfg.paths.root).strip() != "", "paths.root: must name a folder (it is empty)")
    for field in (*OUTPUT_FOLDERS, *OUTPUT_FILES):
        value = str(OmegaConf.select(cfg, field))
        if is_remote(value):  # a remote storage_path (s3://, gs://): Ray Train writes it, not this machine
            continue
        path = Path(value).expanduser()
        if field in OUTPUT_FOLDERS:
            _require(not path.exists() or path.is_dir(), f"{field}: '{path}' is a file, not a folder")
        else:
            _require(not path.is_dir(), f"{field}: '{path}' is a folder, not the file to write")
        blocking = next((parent for parent in path.parents if parent.exists() and not parent.is_dir()), None)
        _require(blocking is None, f"{field}: '{blocking}' above '{path}' is a file, not a folder")


def _require_path(prompt_set: Any, field: str) -> None:
    """A prompt set read from a file or the hub (data, an eval set) names it in `path`."""
    _require(prompt_set.source in OFFLINE_SOURCES or bool(prompt_set.path),
             f"{field}.path: required when {field}.source is '{prompt_set.source}'")


def _validate_evaluation(evaluation: schema_module.EvaluationConfig) -> None:
    _require(evaluation.batch_size >= 1, "evaluation.batch_size: must be >= 1")
    _require(evaluation.prompts_per_set >= 1, "evaluation.prompts_per_set: must be >= 1")
    _require(evaluation.max_new_tokens >= 1, "evaluation.max_new_tokens: must be >= 1")
    _require(evaluation.profile_prompts >= 0, "evaluation.profile_prompts: must be >= 0 (0 = no profile)")
    _require(evaluation.profile_max_new_tokens is None or evaluation.profile_max_new_tokens >= 1,
             "evaluation.profile_max_new_tokens: must be >= 1, or null for evaluation.max_new_tokens")
    _require(len(evaluation.datasets) >= 1, "evaluation.datasets: name at least one eval set (held_out)")
    for name in evaluation.datasets:
        known = ", ".join(["held_out", *sorted(evaluation.sets)])
        _require(name == "held_out" or name in evaluation.sets,
                 f"evaluation.datasets: unknown eval set '{name}'; known: {known}")
        if name != "held_out":
            from pipeline.evaluation.eval_sets import set_config

            definition = set_config(name, evaluation)  # unknown or mistyped fields fail here, before any stage runs
            _require_path(definition, f"evaluation.sets.{name}")
            if definition.source in WRITTEN_BY_THE_VERIFIER:
                check_synthetic_config(definition.synthetic, f"evaluation.sets.{name}.synthetic")
    _require(str(evaluation.vllm.enabled).lower() in ("auto", "true", "false"),
             "evaluation.vllm.enabled: must be auto, true or false")
    _require_fraction(evaluation.vllm.memory_fraction, "evaluation.vllm.memory_fraction")
    _require(evaluation.vllm.max_model_len >= 1, "evaluation.vllm.max_model_len: must be >= 1")
    from pipeline.evaluation.vllm_check import cross_check_off

    _require(cross_check_off(evaluation.vllm) or evaluation.vllm.max_model_len > evaluation.max_new_tokens,
             f"evaluation.vllm.max_model_len: must exceed evaluation.max_new_tokens={evaluation.max_new_tokens} "
             "(each eval prompt and its decode fit in it), unless evaluation.vllm.enabled=false")
    _require(evaluation.vllm.kv_cache_gb is None or evaluation.vllm.kv_cache_gb > 0,
             "evaluation.vllm.kv_cache_gb: must be > 0 (or null)")
    _require(evaluation.vllm.timeout_s >= 1, "evaluation.vllm.timeout_s: must be >= 1")
    _require(evaluation.vllm.near_tie_steps >= 0, "evaluation.vllm.near_tie_steps: must be >= 0 (rounding steps)")
    _require(evaluation.gate.max_tau_gap >= 0, "evaluation.gate.max_tau_gap: must be >= 0")
    _require(evaluation.gate.min_tau_gain >= 0,
             "evaluation.gate.min_tau_gain: must be >= 0 (a negative gain would promote a worse drafter)")
    _validate_alias(evaluation.gate.alias)


def _validate_registry_names(cfg: DictConfig) -> None:
    """The MLflow experiment and registered model names (the latter's default, <verifier.name>-<drafter.name>,
    named by where it comes from; not checked when nothing is registered)."""
    from pipeline.tracking import check_registry_names

    explicit = cfg.tracking.registered_model_name
    if not cfg.tracking.register and not explicit:
        check_registry_names(cfg.tracking.experiment_name, "unregistered", "tracking.registered_model_name")
        return
    model_field = ("tracking.registered_model_name" if explicit
                   else "verifier.name (the default tracking.registered_model_name is <verifier.name>-<drafter.name>)")
    check_registry_names(cfg.tracking.experiment_name, explicit or f"{cfg.verifier.name}-{cfg.drafter.name}",
                         model_field)


def _validate_alias(alias: str) -> None:
    """MLflow's own rules for a registry alias (characters, length, the reserved `latest` and `v<N>`), checked before
    any stage runs instead of at the promotion after training."""
    from pipeline.tracking import check_alias_name

    check_alias_name(alias, "evaluation.gate.alias")


def _validate_val_tau(training: DictConfig) -> None:
    _require(0 <= training.val_tau_samples <= training.val_samples,
             f"training.val_tau_samples: must be in 0..training.val_samples ({training.val_samples}): val.tau "
             "decodes the prompts of held-out samples")
    _require(training.val_tau_max_new_tokens >= 1, "training.val_tau_max_new_tokens: must be >= 1")
    _require(training.select_best_by != "val.tau" or training.val_tau_samples > 0,
             "training.select_best_by: val.tau needs training.val_tau_samples > 0")


def _validate_optimizer(training: DictConfig) -> None:
    _require(0.0 <= training.min_lr_ratio <= 1.0, "training.min_lr_ratio: must be in [0, 1]")
    for key in ("lr", "muon_lr"):
        _require(training[key] > 0, f"training.{key}: must be > 0")
    for key in ("weight_decay", "muon_weight_decay", "muon_momentum"):
        _require(training[key] >= 0, f"training.{key}: must be >= 0")
    _require(training.muon_momentum < 1, "training.muon_momentum: must be < 1")


def _validate_no_credentials(resolved: dict) -> None:
    """Every value the config holds reaches MLflow params, and its URIs the Serve config, a manifest or a log line:
    none may carry a secret (a user or password in a URI, a password or token in its query), whichever field holds
    it (tracking, cluster.address, a data or eval-set path, ...)."""
    import os

    from pipeline.tracking import refuse_credentials

    # cluster first: cluster.mlflow_uri interpolates into tracking.tracking_uri, and the message names where it is set
    for field, value in _leaves({"cluster": resolved.get("cluster"), **resolved}):
        if isinstance(value, str) and "://" in value:
            refuse_credentials(value, field)
    if os.environ.get("MLFLOW_TRACKING_URI"):
        refuse_credentials(os.environ["MLFLOW_TRACKING_URI"], "MLFLOW_TRACKING_URI")


def _validate_training_cadence(training: DictConfig) -> None:
    """Counts the loop divides or indexes by: a 0 here fails only after minutes of data loading and training."""
    for key in ("micro_batch_size", "grad_accum_steps", "checkpoint_every", "log_every", "keep_checkpoints"):
        _require(training[key] >= 1, f"training.{key}: must be >= 1")
    _require(training.warmup_steps >= 0, "training.warmup_steps: must be >= 0")
    _require(training.grad_clip >= 0, "training.grad_clip: must be >= 0 (0 = no clipping)")


def _require_fraction(value: float, field: str) -> None:
    _require(0 < value <= 1, f"{field}: must be in (0, 1] (a share of device memory), got {value}")


def _validate_generation_parallelism(gen: DictConfig) -> None:
    _require(gen.tensor_parallel_size >= 1, "generation.tensor_parallel_size: must be >= 1")
    _require(gen.cpus_per_actor >= 1, "generation.cpus_per_actor: must be >= 1")
    _require(gen.torch_threads >= 1, "generation.torch_threads: must be >= 1")
    _require_fraction(gen.gpu_memory_utilization, "generation.gpu_memory_utilization")
    _require(gen.tensor_parallel_size == 1 or (gen.backend == "vllm" and (gen.capture_backend or "vllm") == "vllm"),
             "generation.tensor_parallel_size: > 1 needs generation.backend=vllm (and a vllm capture_backend)")


def _engines_that_fit(cluster: DictConfig, gpus_per_engine: int) -> int:
    """vLLM engines of this many GPUs the cluster holds: a tensor-parallel group never spans two nodes."""
    return cluster.num_nodes * (cluster.gpus_per_node // gpus_per_engine)


def _validate_cluster_shape(cfg: DictConfig) -> None:
    """On a GPU cluster every GPU count the config asks for must fit the cluster's shape: one training worker per
    GPU, vLLM engines whose tensor-parallel groups stay inside one node."""
    cluster = cfg.cluster
    _require(cluster.local_num_cpus is None or cluster.local_num_cpus >= 1,
             "cluster.local_num_cpus: must be >= 1 (or null for every CPU of this machine)")
    # The pods run as non-root (pipeline/infra/kuberay.py: runAsNonRoot): user 0 would never start.
    _require(cluster.kubernetes.run_as_user >= 1, "cluster.kubernetes.run_as_user: must be >= 1 (the pods run as "
             "non-root)")
    _require(cluster.kubernetes.head_cpus >= 1, "cluster.kubernetes.head_cpus: must be >= 1")
    _require(cluster.launcher.disk_gb >= 1, "cluster.launcher.disk_gb: must be >= 1")
    # Each names something the manifests and launcher configs write as is (an image, a namespace, a secret, a
    # machine type): an empty one renders a file the schemas accept and the cluster rejects at pod start.
    for group in ("kubernetes", "launcher"):
        for key, value in cluster[group].items():
            _require(not isinstance(value, str) or (value.strip() != "" and value.strip() == value),
                     f"cluster.{group}.{key}: must be a non-empty name without surrounding spaces, got {value!r}")
    tensor_parallel = cfg.evaluation.vllm.tensor_parallel_size
    _require(tensor_parallel >= 1, "evaluation.vllm.tensor_parallel_size: must be >= 1")
    if not cluster.use_gpu:
        _require(tensor_parallel == 1, "evaluation.vllm.tensor_parallel_size: GPUs of the job driver's node; 1 "
                                       "without cluster.use_gpu")
        return
    total = cluster.num_nodes * cluster.gpus_per_node
    shape = f"cluster {cluster.name} has {cluster.num_nodes} node(s) x {cluster.gpus_per_node} GPU(s)"
    for key in ("num_nodes", "gpus_per_node"):
        _require(cluster[key] >= 1, f"cluster.{key}: cluster.use_gpu needs GPU nodes ({shape})")
    _require(cfg.training.num_workers == total,
             f"training.num_workers: {cfg.training.num_workers} training workers, but {shape}: one worker per GPU")
    gen = cfg.generation
    if gen.use_gpu:
        _require(gen.tensor_parallel_size <= cluster.gpus_per_node,
                 f"generation.tensor_parallel_size: {gen.tensor_parallel_size} GPUs per engine, but {shape}")
        _require(gen.num_actors <= _engines_that_fit(cluster, gen.tensor_parallel_size),
                 f"generation.num_actors: {gen.num_actors} verifier actors of {gen.tensor_parallel_size} GPU(s) each "
                 f"do not fit: {shape}")
    # the vLLM cross-check runs beside the job driver, on the GPUs of its node
    _require(tensor_parallel <= cluster.gpus_per_node,
             f"evaluation.vllm.tensor_parallel_size: {tensor_parallel} GPUs for the vLLM cross-check, but {shape}")
    serving = cfg.serving
    if serving.accelerator == "gpu":
        _require(serving.tensor_parallel_size <= cluster.gpus_per_node,
                 f"serving.tensor_parallel_size: {serving.tensor_parallel_size} GPUs per replica, but {shape}")
        replicas = int(serving.autoscaling.get("max_replicas", 1))  # a number: _check_autoscaling ran first
        _require(replicas <= _engines_that_fit(cluster, serving.tensor_parallel_size),
                 f"serving.autoscaling.max_replicas: {replicas} replicas of {serving.tensor_parallel_size} GPU(s) "
                 f"each do not fit: {shape}")


def _check_autoscaling(autoscaling: DictConfig) -> None:
    """serving.autoscaling is handed to Ray Serve as its autoscaling_config: checked here by Ray Serve's own model
    (types, min_replicas <= max_replicas, ...), and a key that model does not have is refused rather than ignored.
    Raises PipelineError naming the field."""
    import pydantic
    from ray.serve.config import AutoscalingConfig

    settings = {str(key): value for key, value in autoscaling.items()}
    for key in settings:
        _require(key in AutoscalingConfig.model_fields,
                 f"serving.autoscaling.{key}: not a Ray Serve autoscaling setting "
                 f"(one of {sorted(AutoscalingConfig.model_fields)})")
    try:
        AutoscalingConfig(**settings)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise PipelineError(f"serving.autoscaling{'.' + where if where else ''}: {first['msg']}") from None


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _validate_serving(serving: DictConfig) -> None:
    for key in ("port", "metrics_port"):
        _require(1 <= serving[key] <= 65535, f"serving.{key}: must be a TCP port (1..65535)")
    _require(serving.metrics_port != serving.port, f"serving.metrics_port: {serving.metrics_port} is serving.port's "
                                                   "too; Ray's metrics endpoint needs a port of its own")
    _require(serving.tensor_parallel_size >= 1, "serving.tensor_parallel_size: must be >= 1")
    _require_fraction(serving.memory_fraction, "serving.memory_fraction")
    _require(serving.max_model_len >= 1, "serving.max_model_len: must be >= 1")
    _require(serving.num_speculative_tokens is None or serving.num_speculative_tokens >= 1,
             "serving.num_speculative_tokens: must be >= 1 (or null for the evaluation's recommended K)")
    _require(serving.max_request_bytes >= 1024, "serving.max_request_bytes: must be >= 1024")
    # A name, never the key: the value goes into params, the Serve config and the manifests' command lines as is.
    _require(serving.api_key_env is None or ENV_NAME.fullmatch(str(serving.api_key_env)) is not None,
             "serving.api_key_env: must name the environment variable holding the API key (letters, digits and _, "
             "e.g. SPECULATOR_API_KEY), not hold the key; the value given is not repeated here")
    _require(_is_loopback(serving.host) or bool(serving.api_key_env),
             f"serving.host: '{serving.host}' reaches beyond this machine; set serving.api_key_env to the variable "
             "holding an API key (or bind to 127.0.0.1)")
    if serving.model is not None:
        from pipeline.serving.registry import check_model_uri

        check_model_uri(str(serving.model))
    _check_autoscaling(serving.autoscaling)
