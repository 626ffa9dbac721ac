"""Hydra entry point: `python jobs/serve.py [overrides]` serves the registered speculator with vLLM on Ray Serve,
behind an OpenAI-compatible endpoint (127.0.0.1:8000 by default)."""

import os
import sys

# This folder holds a script named pipeline.py, which would shadow the `pipeline` package.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from pipeline.config import register_configs  # noqa: E402
from pipeline.logs import setup_job_logging  # noqa: E402
from pipeline.serving.job import run_serve  # noqa: E402

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    setup_job_logging()
    code = run_serve(cfg)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
