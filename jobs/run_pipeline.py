"""Hydra entry point: `python jobs/pipeline.py [overrides]` or `ray job submit -- python jobs/pipeline.py ...`."""

import os
import sys

# This folder holds a script named pipeline.py, which would shadow the `pipeline` package.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from pipeline.config import register_configs  # noqa: E402
from pipeline.runner import run_job  # noqa: E402

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    code = run_job(cfg, "pipeline")
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
