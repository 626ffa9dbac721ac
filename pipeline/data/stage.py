"""Stage 1: the prompt set, split into training prompts and held-out evaluation prompts."""

from __future__ import annotations

import logging
from pathlib import Path

import datasets

from pipeline.context import Context, load_saved_dataset, save_dataset_atomic
from pipeline.data.prompts import WRITTEN_BY_THE_VERIFIER, check_file_unchanged, load_prompts, split_prompts

log = logging.getLogger(__name__)


def prompts_saved(folder: Path) -> bool:
    """Whether the prompts stage saved both splits in `folder`: a run stopped between the two left only one."""
    return (folder / "train").is_dir() and (folder / "held_out").is_dir()


def run(ctx: Context) -> tuple[datasets.Dataset, datasets.Dataset]:
    folder = ctx.paths.prompts
    if not prompts_saved(folder):
        writer = ctx.prompt_writer() if ctx.cfg.data.source in WRITTEN_BY_THE_VERIFIER else None
        prompts = load_prompts(ctx.cfg.data, writer)
        check_file_unchanged(ctx.cfg.data.path, ctx.paths.prompt_file_sha256, "data.path")
        train, held_out = split_prompts(prompts, ctx.cfg.data)
        save_dataset_atomic(train, folder / "train")
        save_dataset_atomic(held_out, folder / "held_out")
    train = load_saved_dataset(folder / "train", "prompts")
    held_out = load_saved_dataset(folder / "held_out", "prompts")
    log.info("prompts: %d train, %d held out (%s)", len(train), len(held_out), folder)
    ctx.log_metrics({"prompts.train": len(train), "prompts.held_out": len(held_out)})
    ctx.set_tags({"prompts.key": ctx.paths.prompts_key, "prompts.source": ctx.cfg.data.source})
    return train, held_out
