"""Model architectures (architecture only), checkpoint name maps, and loading."""
from .loading import load_model

__all__ = ["load_model"]
