"""Hydra entry point of the whole chain: `python jobs/run_pipeline.py [overrides]`, or
`ray job submit -- python jobs/run_pipeline.py ...` on a cluster."""

import sys

import hydra
from omegaconf import DictConfig

from pipeline.config import register_configs
from pipeline.entry import run_hydra_main, run_job

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    code = run_job(cfg, "pipeline")
    if code:
        sys.exit(code)


if __name__ == "__main__":
    run_hydra_main(main)
