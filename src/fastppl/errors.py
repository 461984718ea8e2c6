"""User-facing errors: one line that names the problem and what to do; the CLI exits 2 on them."""


def is_out_of_memory(error: BaseException) -> bool:
    """A device out-of-memory error (torch.OutOfMemoryError, or a kernel's own message saying so)."""
    return type(error).__name__ == "OutOfMemoryError" or "out of memory" in str(error).lower()


class FastpplError(Exception):
    """Bad input or configuration. The message is shown to the user as is, without a traceback."""


def first_line(error: BaseException, limit: int = 200) -> str:
    """The first line of an error's message (its type name when it has none), at most limit characters:
    what a one-line FastpplError quotes of a library's exception."""
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:limit]
