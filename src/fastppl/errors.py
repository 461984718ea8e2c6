"""User-facing errors: one line that names the problem and what to do; the CLI exits 2 on them."""


def is_out_of_memory(error: BaseException) -> bool:
    """A device out-of-memory error (torch.OutOfMemoryError, or a kernel's own message saying so)."""
    return type(error).__name__ == "OutOfMemoryError" or "out of memory" in str(error).lower()


class FastpplError(Exception):
    """Bad input or configuration. The message is shown to the user as is, without a traceback."""
