"""Model specifications and presets."""
from .parse import model_from_dict, parse_model
from .presets import PUBLIC_PARAMS, get, names
from .spec import DTYPE_BYTES, REGIONS, ModelSpec, TensorSpec, gpt, moe

__all__ = ["ModelSpec", "TensorSpec", "gpt", "moe", "get", "names", "PUBLIC_PARAMS", "DTYPE_BYTES", "REGIONS", "parse_model",
           "model_from_dict"]
