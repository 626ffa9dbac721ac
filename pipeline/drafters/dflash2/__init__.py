from pipeline.drafters.dflash2.model import DFlash2Drafter

__all__ = ["DFlash2Drafter"]
