"""Model specifications and presets."""
from .presets import PUBLIC_PARAMS, get, names
from .spec import DTYPE_BYTES, REGIONS, ModelSpec, TensorSpec, gpt, moe

__all__ = ["ModelSpec", "TensorSpec", "gpt", "moe", "get", "names", "PUBLIC_PARAMS", "DTYPE_BYTES", "REGIONS"]
