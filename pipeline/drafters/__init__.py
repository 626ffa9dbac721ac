"""Drafter registry: name (== the checkpoint's speculators_model_type) -> model class."""

from pipeline.drafters.peagle import PEagleDrafter

DRAFTERS = {PEagleDrafter.algorithm: PEagleDrafter}


def drafter_class(name: str):
    from pipeline.errors import PipelineError

    if name not in DRAFTERS:
        raise PipelineError(f"drafter.name: '{name}' is not one of {sorted(DRAFTERS)}")
    return DRAFTERS[name]
