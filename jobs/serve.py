"""Hydra entry point: `python jobs/serve.py [overrides]` serves the registered speculator with vLLM on Ray Serve,
behind an OpenAI-compatible endpoint (127.0.0.1:8000 by default)."""

import sys

import hydra
from omegaconf import DictConfig

from pipeline.config import register_configs
from pipeline.entry import run_hydra_main
from pipeline.logs import setup_job_logging
from pipeline.serving.job import STOPPED_SERVING, run_serve

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    setup_job_logging()
    code = run_serve(cfg)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    run_hydra_main(main, stopped=STOPPED_SERVING)
