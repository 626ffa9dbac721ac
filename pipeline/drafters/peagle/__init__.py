from pipeline.drafters.peagle.model import PEagleDrafter

__all__ = ["PEagleDrafter"]
