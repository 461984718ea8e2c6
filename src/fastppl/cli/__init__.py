"""The command line: one module per subcommand, each a thin mapping from arguments onto configs."""
from .entry import main, run

__all__ = ["main", "run"]
