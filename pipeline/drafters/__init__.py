"""Drafter registry: name (== the checkpoint's speculators_model_type) -> model class.

Every class offers the same surface: ``training_loss(samples, options, generator)`` -> (loss, correct [K],
total [K]); ``draft(aux_hidden, next_ids, num_drafts)`` -> target token ids; ``default_aux_layer_ids(n)``.
"""

from pipeline.drafters.dflash import DFlashDrafter
from pipeline.drafters.dspark import DSparkDrafter
from pipeline.drafters.eagle3 import Eagle3Drafter
from pipeline.drafters.peagle import PEagleDrafter

DRAFTERS = {cls.algorithm: cls for cls in (Eagle3Drafter, PEagleDrafter, DFlashDrafter, DSparkDrafter)}


def drafter_class(name: str):
    from pipeline.errors import PipelineError

    if name not in DRAFTERS:
        raise PipelineError(f"drafter.name: '{name}' is not one of {sorted(DRAFTERS)}")
    return DRAFTERS[name]
