"""Drafter registry: name (== the checkpoint's speculators_model_type) -> model class.

Every class meets pipeline.drafters.protocol.Drafter (its options, ``training_loss``, ``draft``, default aux
layers). A new drafter is a folder pipeline/drafters/<name>/ and one entry in DRAFTERS below.
"""

from pipeline.drafters.base import DrafterBase
from pipeline.drafters.dflash import DFlashDrafter
from pipeline.drafters.dflash2 import DFlash2Drafter
from pipeline.drafters.dspark import DSparkDrafter
from pipeline.drafters.eagle3 import Eagle3Drafter
from pipeline.drafters.peagle import PEagleDrafter

DRAFTERS: dict[str, type[DrafterBase]] = {
    cls.algorithm: cls for cls in (Eagle3Drafter, PEagleDrafter, DFlashDrafter, DSparkDrafter, DFlash2Drafter)}


def drafter_class(name: str) -> type[DrafterBase]:
    from pipeline.errors import PipelineError

    if name not in DRAFTERS:
        raise PipelineError(f"drafter.name: '{name}' is not one of {sorted(DRAFTERS)}")
    return DRAFTERS[name]


def drafter_config(name: str, **options):
    """The DictConfig of `name`'s own schema with `options` over its defaults (what `drafter=<name>` composes,
    without conf/drafter's file). Raises PipelineError for an unknown name, and OmegaConf's ConfigKeyError naming
    an option the drafter does not have."""
    from omegaconf import OmegaConf

    return OmegaConf.merge(OmegaConf.structured(drafter_class(name).config_class), options)
