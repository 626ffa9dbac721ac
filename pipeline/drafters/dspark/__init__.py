from pipeline.drafters.dspark.model import DSparkDrafter

__all__ = ["DSparkDrafter"]
