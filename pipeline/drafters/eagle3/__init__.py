from pipeline.drafters.eagle3.model import Eagle3Drafter

__all__ = ["Eagle3Drafter"]
