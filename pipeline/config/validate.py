"""Semantic checks the schema's types cannot express. Each error names the config field."""

from __future__ import annotations

from omegaconf import DictConfig

from pipeline.errors import PipelineError

KNOWN_STAGES = ("prompts", "regenerate", "capture", "train", "evaluate", "export")
KNOWN_SOURCES = ("humaneval", "jsonl", "parquet", "hub")
KNOWN_DTYPES = ("float32", "bfloat16", "float16")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise PipelineError(message)


def validate(cfg: DictConfig) -> None:
    from pipeline.drafters import DRAFTERS

    _require(cfg.data.source in KNOWN_SOURCES, f"data.source: '{cfg.data.source}' is not one of {KNOWN_SOURCES}")
    _require(
        cfg.data.source == "humaneval" or bool(cfg.data.path),
        f"data.path: required when data.source is '{cfg.data.source}'",
    )
    _require(cfg.data.num_train > 0, "data.num_train: must be > 0")
    _require(cfg.data.num_eval >= 0, "data.num_eval: must be >= 0")
    _require(cfg.generation.backend == "hf", f"generation.backend: '{cfg.generation.backend}' is not supported (hf)")
    _require(cfg.generation.max_new_tokens > 0, "generation.max_new_tokens: must be > 0")
    _require(cfg.generation.max_length > 8, "generation.max_length: must be > 8")
    _require(cfg.drafter.name in DRAFTERS, f"drafter.name: '{cfg.drafter.name}' is not one of {sorted(DRAFTERS)}")
    _require(cfg.drafter.num_speculative_tokens >= 1, "drafter.num_speculative_tokens: must be >= 1")
    _require(0.0 < cfg.drafter.depth_keep_decay <= 1.0, "drafter.depth_keep_decay: must be in (0, 1]")
    _require(cfg.training.num_workers >= 1, "training.num_workers: must be >= 1")
    _require(cfg.training.max_steps >= 1, "training.max_steps: must be >= 1")
    _require(cfg.deepspeed.zero_stage in (0, 1, 2, 3), "deepspeed.zero_stage: must be 0, 1, 2 or 3")
    _require(
        1 <= cfg.evaluation.num_speculative_tokens <= cfg.drafter.num_speculative_tokens,
        "evaluation.num_speculative_tokens: must be between 1 and drafter.num_speculative_tokens",
    )
    for key in ("save_dtype", "compute_dtype"):
        value = cfg.verifier[key]
        _require(value in KNOWN_DTYPES, f"verifier.{key}: '{value}' is not one of {KNOWN_DTYPES}")
    for stage in cfg.stages:
        _require(stage in KNOWN_STAGES, f"stages: unknown stage '{stage}'; known: {KNOWN_STAGES}")
