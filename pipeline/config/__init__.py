"""Config schemas, their registration in Hydra's ConfigStore, and semantic validation."""

from pipeline.config.registration import CONF_DIR, compose, register_configs
from pipeline.config.validate import validate

__all__ = ["CONF_DIR", "compose", "register_configs", "validate"]
