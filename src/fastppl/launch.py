"""`python -m fastppl.launch TORCHRUN-ARGS`: torchrun in this process, for `fastppl ... --nproc N`.

torchrun's own entry point answers a failed rank with a ChildFailedError report and its Python traceback, and
exits 1 whatever the rank's status was. Here the ranks have already said what went wrong on stderr (one line,
from rank 0, for bad input: fastppl.cli), so the report is dropped and the exit status is the first failed
rank's: 2 for bad input, as one process gives. A rank killed by a signal (kill -9, the out-of-memory killer)
said nothing: this process names it in one line, and exits 128 + the signal's number, as a shell reports a
process killed so. Interrupted (Ctrl-C, or SIGTERM from a scheduler), it stops the ranks and leaves saying so to
the `fastppl` process that started it."""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Sequence

# set for the ranks that --nproc starts (fastppl.distributed.relaunch_under_torchrun)
RELAUNCHED_ENV = "FASTPPL_NPROC_RELAUNCH"


def is_rank_under_nproc() -> bool:
    return bool(os.environ.get(RELAUNCHED_ENV)) and "RANK" in os.environ


def stop_silently_on_interrupt() -> None:
    """A rank that --nproc started dies at once on SIGINT, which torchrun forwards on Ctrl-C: the `fastppl` process
    that started torchrun says "interrupted" once, and a rank interrupted inside a collective cannot answer with
    its peer's "Connection closed" error and C++ frames."""
    if is_rank_under_nproc():
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def shell_status(returncode: int) -> int:
    """A process's exit status as a shell reports it: killed by signal s (returncode -s) is 128 + s."""
    return 128 - returncode if returncode < 0 else returncode


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def killed_rank_message(rank: int, returncode: int) -> str:
    """The one line for a rank that a signal killed (returncode -s): it could not say anything itself."""
    name = signal_name(-returncode)
    cause = " (kill -9, or the system's out-of-memory killer: see dmesg)" if -returncode == signal.SIGKILL else ""
    return (f"fastppl: error: rank {rank} was killed by {name} (signal {-returncode}){cause}; the job stopped and "
            "wrote no result")


def run_torchrun(torchrun_args: Sequence[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run
    # their "failed (exitcode: 2)", "closing signal" and "Received 2 death signal" lines repeat what is said here
    for name in ("torch.distributed.elastic.multiprocessing", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(list(torchrun_args)))
    except ChildFailedError as error:
        rank, first = error.get_first_failure()
        if first.exitcode < 0:
            print(killed_rank_message(rank, first.exitcode), file=sys.stderr)
        return shell_status(first.exitcode)
    except SignalException as interrupted:   # torchrun has stopped the ranks with the same signal
        return 128 + int(interrupted.sigval)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(run_torchrun(sys.argv[1:]))
    except KeyboardInterrupt:   # before torchrun's own handlers are in place
        sys.exit(130)
