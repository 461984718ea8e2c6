"""transformers' own warnings and progress bars kept off stderr, where fastppl's errors are one line."""
import contextlib


@contextlib.contextmanager
def quiet_transformers():
    """Errors only, no progress bars, for the duration; problems that matter are raised or checked by fastppl."""
    from transformers.utils import logging as hf_logging
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
