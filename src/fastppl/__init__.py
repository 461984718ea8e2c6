"""fastppl: exact next-token NLL, perplexity and bits per byte of causal language models, fast."""
__version__ = "0.1.0"

from .config import EvalConfig  # noqa: E402
from .errors import FastpplError  # noqa: E402


def evaluate(config: EvalConfig):
    """The run's EvalResult (fastppl.report.result): typed fields, to_dict() the --json report, and read access to
    that report's fields by name (result["nll"]). A FastpplError names options as EvalConfig's fields."""
    from .config import in_python_spelling
    from .pipeline import evaluate as _evaluate
    try:
        return _evaluate(config)
    except FastpplError as e:
        raise in_python_spelling(e) from None


def load_model(spec: str, backend: str = "auto", dtype=None, seed: int = 0, device="cpu"):
    import torch
    from .config import in_python_spelling
    from .models import load_model as _load_model
    try:
        return _load_model(spec, backend, dtype or torch.float32, seed, device)
    except FastpplError as e:
        raise in_python_spelling(e) from None


__all__ = ["EvalConfig", "FastpplError", "evaluate", "load_model", "__version__"]
