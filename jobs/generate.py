"""Hydra entry point: `python jobs/generate.py [overrides]` or `ray job submit -- python jobs/generate.py ...`."""

import sys

import hydra
from omegaconf import DictConfig

from pipeline.config import register_configs
from pipeline.entry import run_hydra_main, run_job

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    code = run_job(cfg, "generate")
    if code:
        sys.exit(code)


if __name__ == "__main__":
    run_hydra_main(main)
