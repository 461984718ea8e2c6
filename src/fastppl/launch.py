"""`python -m fastppl.launch TORCHRUN-ARGS`: torchrun in this process, for `fastppl ... --nproc N`.

torchrun's own entry point answers a failed rank with a ChildFailedError report and its Python traceback, and
exits 1 whatever the rank's status was. Here the ranks have already said what went wrong on stderr (one line,
from rank 0, for bad input: fastppl.cli), so the report is dropped and the exit status is the first failed
rank's: 2 for bad input, as one process gives."""
from __future__ import annotations

import logging
import sys
from typing import Sequence


def shell_status(returncode: int) -> int:
    """A process's exit status as a shell reports it: killed by signal s (returncode -s) is 128 + s."""
    return 128 - returncode if returncode < 0 else returncode


def run_torchrun(torchrun_args: Sequence[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run
    # its "failed (exitcode: 2)" and "Sending process ... closing signal" lines repeat what the ranks said
    logging.getLogger("torch.distributed.elastic.multiprocessing").setLevel(logging.CRITICAL)
    try:
        run(parse_args(list(torchrun_args)))
    except ChildFailedError as error:
        _, first = error.get_first_failure()
        return shell_status(first.exitcode)
    return 0


if __name__ == "__main__":
    sys.exit(run_torchrun(sys.argv[1:]))
