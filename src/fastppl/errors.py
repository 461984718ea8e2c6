"""User-facing errors: one line that names the problem and what to do; the CLI exits 2 on them."""


class FastpplError(Exception):
    """Bad input or configuration. The message is shown to the user as is, without a traceback."""
