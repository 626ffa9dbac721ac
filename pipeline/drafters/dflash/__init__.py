from pipeline.drafters.dflash.model import DFlashDrafter

__all__ = ["DFlashDrafter"]
