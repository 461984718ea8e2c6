"""Data-parallel evaluation on torch.distributed, opt-in from torchrun's environment.

    torchrun --nproc-per-node N -m fastppl eval ...      (or: fastppl eval --nproc N ...)

What each rank does:
  1. reads, tokenises and windows the whole corpus, exactly as one process would. Every rank therefore
     validates the same input in the same order and a bad input raises the same FastpplError everywhere,
     before any collective; `tokens_scored`, bytes and every other corpus count come out identical on all
     ranks, so only the sums of the scoring need reducing;
  2. scores only its share of the planned batches, `shard_plans(plans, rank, world_size)`, balanced by
     padded tokens (the batches are one process's, so per-token values do not depend on the ranks);
  3. all-reduces, once at the end, the float64 sums (nll_sum, the per-position sums and counts) and the
     per-token buffer (each rank fills only the slots it scored, NaN elsewhere; a MIN reduction with NaN
     read as +inf merges them exactly, so per-token values are bit-identical to one process).
Only rank 0 shows the progress bar and writes the report; every rank returns the same result.

Failure protocol (nothing hangs, no report is written):
  - A rank that raises anywhere in `evaluate` publishes "rank R: <message>" to the rendezvous store (the
    first rank to publish wins) and exits with its own error.
  - The other ranks look at the store at most once a second while scoring (one TCP round trip, no
    device sync) and at the two store barriers (before scoring and before the final reduce), and stop with
    PeerFailed("rank R failed: <message>"). So the job stops within about a second of scoring, or within
    the time the others need to reach their next barrier.
  - A rank that dies without a word (SIGKILL, machine lost): torchrun stops the other ranks on its
    machine at once; ranks on other machines stop at the next barrier after FASTPPL_DIST_TIMEOUT seconds
    (default 600), which is also the process group's timeout for the collectives.
"""
from __future__ import annotations

import dataclasses

import atexit
import functools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from .data.batching import Batch
from .engine.precision import resolve_device
from .engine.score import DeviceSums
from .errors import FastpplError

TIMEOUT_ENV = "FASTPPL_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
POLL_INTERVAL_S = 1.0


class PeerFailed(FastpplError):
    """Another rank failed first. `silent` ranks (all but rank 0) leave printing it to rank 0. exit_code is the
    one the failed rank exits with (2 for bad input, 1 for a crash, 130 when interrupted), so that every rank of
    the job, and `--nproc`, report the same kind of failure."""

    def __init__(self, message: str, silent: bool, exit_code: int = 2):
        super().__init__(message)
        self.silent = silent
        self.exit_code = exit_code


# ---------------------------------------------------------------------------------------------------------
# sharding (pure)

def shard_plans(plans: Sequence, rank: int, world_size: int) -> list:
    """The planned batches `rank` scores: greedily, each batch (largest first, as planned) onto the rank
    with the fewest padded tokens so far; ties to the lower rank. Every rank computes the same split, and
    the batches are those of one process, so per-token values do not depend on the number of ranks."""
    assert 0 <= rank < world_size
    load = [0] * world_size
    mine = []
    for plan in plans:
        owner = min(range(world_size), key=lambda r: (load[r], r))
        load[owner] += plan.n_rows * plan.seq_len
        if owner == rank:
            mine.append(plan)
    return mine


# ---------------------------------------------------------------------------------------------------------
# the launch environment (pure)

@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    local_rank_given: bool
    restart: int            # TORCHELASTIC_RESTART_COUNT: keeps store keys of a restarted job apart


def _int_variable(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise FastpplError(f"environment variable {name}={environ[name]!r} is not an integer") from None


def launch_env(environ: Mapping[str, str] = os.environ) -> Optional[LaunchEnv]:
    """The torchrun variables of this process, or None when it runs alone (no WORLD_SIZE, or 1)."""
    if "WORLD_SIZE" not in environ:
        return None
    world_size = _int_variable(environ, "WORLD_SIZE")
    if world_size <= 1:
        return None
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in environ]
    if missing:
        raise FastpplError(f"WORLD_SIZE is {world_size} but {', '.join(missing)} is not set; "
                           "start the processes with torchrun (see docs/distributed.md)")
    rank = _int_variable(environ, "RANK")
    if not 0 <= rank < world_size:
        raise FastpplError(f"RANK {rank} is outside 0..{world_size - 1} (WORLD_SIZE {world_size})")
    local_rank_given = "LOCAL_RANK" in environ
    local_rank = _int_variable(environ, "LOCAL_RANK") if local_rank_given else 0
    restart = _int_variable(environ, "TORCHELASTIC_RESTART_COUNT") if "TORCHELASTIC_RESTART_COUNT" in environ else 0
    return LaunchEnv(rank, world_size, local_rank, local_rank_given, restart)


def rank_device(device_name: str, env: LaunchEnv) -> torch.device:
    """--device for one rank: auto/cuda become cuda:LOCAL_RANK (one GPU per process); cpu stays cpu."""
    device = resolve_device(device_name)
    if device.type != "cuda":
        return device
    if device.index is not None:
        raise FastpplError(f"--device {device_name} names one GPU, but each of the {env.world_size} processes "
                           "needs its own; pass --device cuda (rank r uses cuda:LOCAL_RANK)")
    if not env.local_rank_given:
        raise FastpplError("LOCAL_RANK is not set, so this process cannot pick its GPU; start with torchrun")
    n_gpus = torch.cuda.device_count()
    if env.local_rank >= n_gpus:
        raise FastpplError(f"LOCAL_RANK {env.local_rank} but only {n_gpus} GPU(s) are visible; "
                           f"start at most {n_gpus} process(es) per machine (--nproc-per-node)")
    return torch.device("cuda", env.local_rank)


def timeout_seconds(environ: Mapping[str, str] = os.environ) -> float:
    if TIMEOUT_ENV not in environ:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(environ[TIMEOUT_ENV])
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise FastpplError(f"{TIMEOUT_ENV}={environ[TIMEOUT_ENV]!r}: give a positive number of seconds")
    return seconds


# ---------------------------------------------------------------------------------------------------------
# one rank of a running job

class Distributed:
    """This process' place in the job, and the few collective steps evaluation needs."""

    def __init__(self, env: LaunchEnv, device: torch.device, store, timeout_s: float, owns_group: bool):
        self.rank = env.rank
        self.world_size = env.world_size
        self.local_rank = env.local_rank
        self.device = device
        self.timeout_s = timeout_s
        self.store = store              # the rendezvous store, under our own key prefix
        self.owns_group = owns_group    # we created the process group, so we destroy it at exit
        self.failed = False             # this rank published a failure
        self._n_barriers = 0            # every rank passes the same barriers in the same order
        self._last_poll = float("-inf")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # failures ---------------------------------------------------------------------------------------------
    def publish_failure(self, message: str, exit_code: int = 2) -> None:
        self.failed = True
        try:
            # first writer wins: compare_set only writes when the key is absent
            self.store.compare_set("failure", "", f"{exit_code}|rank {self.rank}: {message}")
        except Exception:
            pass  # the store is gone (its host died): the others find out through it as well

    def check_peers(self, force: bool = False) -> None:
        """Raise PeerFailed if another rank has published a failure (polls at most once a second)."""
        now = time.monotonic()
        if not force and now - self._last_poll < POLL_INTERVAL_S:
            return
        self._last_poll = now
        if self._store_check(["failure"]):
            message = self._store(lambda store: store.get("failure")).decode("utf-8", errors="replace")
            exit_code, _, described = message.partition("|")   # "<status>|rank R: <message>" (publish_failure)
            if not exit_code.isdigit():
                exit_code, described = "1", message
            rank, _, reason = described.partition(": ")
            raise PeerFailed(f"{rank} failed: {reason}", silent=not self.is_main, exit_code=int(exit_code))

    def wait_for_peers(self, stage: str) -> None:
        """A barrier through the store that also watches for failures, so it never waits on a dead rank
        for longer than the timeout."""
        prefix = f"barrier{self._n_barriers}/"
        self._n_barriers += 1
        self._store(lambda store: store.set(f"{prefix}{self.rank}", "1"))
        keys = [f"{prefix}{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + self.timeout_s
        pause = 0.001
        while True:
            self.check_peers(force=True)
            if self._store_check(keys):
                return
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world_size) if not self._store_check([f"{prefix}{r}"])]
                lost = FastpplError(
                    f"rank(s) {', '.join(map(str, missing))} did not get {stage} within {self.timeout_s:.0f} s; "
                    f"a process may have died (see its log); {TIMEOUT_ENV} sets this limit")
                lost.exit_code = 1   # a lost process, not bad input; still published to the other ranks
                raise lost
            time.sleep(pause)
            # at most 5 ms between the last rank's arrival and everyone leaving: the end-of-scoring
            # barrier is inside the timed scoring, and a 1-second job on 8 GPUs should not lose 5 % to it
            pause = min(pause * 2, 0.005)

    def _store(self, call):
        try:
            return call(self.store)
        except RuntimeError:   # DistNetworkError & co: the store's host has gone
            raise PeerFailed("lost the rendezvous store: rank 0 (or torchrun on the first machine) has stopped; "
                             "its log has the reason", silent=False, exit_code=1) from None

    def _store_check(self, keys: list[str]) -> bool:
        return self._store(lambda store: store.check(keys))

    def check_same_inputs(self, parts: dict[str, str]) -> None:
        """Every rank must score the same run: each publishes a digest of each part of its inputs ({what: digest})
        and compares every rank's with rank 0's. On a difference every rank stops with exit code 2, and rank 0
        alone says which rank differs in what (several machines each read their own copy of the files)."""
        self._store(lambda store: store.set(f"inputs/{self.rank}", json.dumps(parts)))
        self.wait_for_peers("to the check of the inputs")
        first = json.loads(self._store(lambda store: store.get("inputs/0")))
        for rank in range(1, self.world_size):
            theirs = json.loads(self._store(lambda store: store.get(f"inputs/{rank}")))
            differing = [what for what in first if theirs.get(what) != first[what]]
            if differing:
                raise PeerFailed(f"rank {rank} has other {', '.join(differing)} than rank 0; give every rank the "
                                 "same arguments, files and model", silent=not self.is_main, exit_code=2)

    # scoring ----------------------------------------------------------------------------------------------
    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (e.g. --batch-size auto, sized from each rank's own free
        memory): the ranks must plan the same batches, or their shares would not partition them. Exchanged
        through the store behind a barrier that watches for failures, so that a rank that failed before it
        (its probe ran out of memory, say) stops the others with its error instead of leaving them in a
        collective."""
        key = f"min{self._n_barriers}"
        self._store(lambda store: store.set(f"{key}/{self.rank}", str(value)))
        self.wait_for_peers("to the choice of the batch size")
        return min(int(self._store(lambda store: store.get(f"{key}/{rank}"))) for rank in range(self.world_size))

    def batch_hook(self, progress, share_tokens: int, total_tokens: int) -> Callable[[Batch], None]:
        """on_batch for score_batches: progress and failure polling. Rank 0's bar shows its own share
        scaled to the whole job: shares are balanced, so its fraction done approximates the job's."""
        scale = total_tokens / share_tokens if share_tokens else 0.0
        done = 0

        def on_batch(batch: Batch) -> None:
            nonlocal done
            done += batch.n_scored
            progress.advance(round(done * scale) - progress.done)
            self.check_peers()

        return on_batch

    def all_reduce_sums(self, sums: DeviceSums, n_scored: int) -> None:
        """Sum every rank's DeviceSums in place, once; afterwards each rank holds the job's sums."""
        self.wait_for_peers("to the end of scoring")
        # every float64 sum (nll, by position, by document, ...) in one all-reduce
        fields = [f.name for f in dataclasses.fields(sums)
                  if isinstance(getattr(sums, f.name), torch.Tensor) and getattr(sums, f.name).dtype == torch.float64]
        flat = torch.cat([getattr(sums, name).reshape(-1) for name in fields])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for name in fields:
            tensor = getattr(sums, name)
            tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
        for per_token in (sums.per_token, sums.divergence):
            if per_token is None:
                continue
            # each slot is scored by exactly one rank: NaN (unscored here) reads as +inf, MIN keeps the score
            merged = torch.where(torch.isnan(per_token), float("inf"), per_token)
            dist.all_reduce(merged, op=dist.ReduceOp.MIN)
            per_token.copy_(torch.where(torch.isinf(merged), float("nan"), merged))
        assert round(float(sums.position_count.sum())) == n_scored, "the ranks' shares do not cover every window once"


_active: Optional[Distributed] = None


def init_distributed(device_name: str) -> Optional[Distributed]:
    """Join the job described by torchrun's environment; None when this process runs alone.

    Idempotent: later calls in the same process return the same object (and keep its device). A process
    group the caller created already (torchrun script using fastppl.evaluate) is reused."""
    global _active
    env = launch_env()
    if env is None:
        return None
    if _active is not None:
        return _active
    device = rank_device(device_name, env)
    timeout_s = timeout_seconds()
    owns_group = not dist.is_initialized()
    if owns_group:
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", timeout=timedelta(seconds=timeout_s), device_id=device)
        else:
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        # the first collective sets up the transport (NCCL connects peers lazily, at first use): do it
        # here, so that the one all-reduce inside the timed scoring does not pay for it
        dist.all_reduce(torch.zeros(1, dtype=torch.float64, device=device))
    if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
        raise FastpplError("the existing process group does not match RANK / WORLD_SIZE of the environment")
    from torch.distributed import distributed_c10d   # the rendezvous store has no public getter
    store = dist.PrefixStore(f"fastppl/{env.restart}/", distributed_c10d._get_default_store())
    _active = Distributed(env, device, store, timeout_s, owns_group)
    atexit.register(_shutdown)
    return _active


def _shutdown() -> None:
    # after a failure the peers may be gone, and tearing down a group with dead peers can block: skip it
    if _active is not None and _active.owns_group and not _active.failed and dist.is_initialized():
        dist.destroy_process_group()


def is_main_process() -> bool:
    """Whether this process prints and writes files: rank 0, or a process that runs alone."""
    return _active is None or _active.is_main


def _describe(error: BaseException) -> str:
    if isinstance(error, FastpplError):
        return str(error)
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__


def _exit_code(error: BaseException) -> int:
    """What fastppl.cli exits with for error: 2 for bad input, 130 when interrupted, 1 for a crash."""
    if isinstance(error, FastpplError):
        return getattr(error, "exit_code", 2)
    return 130 if isinstance(error, KeyboardInterrupt) else 1


def stop_all_on_failure(fn):
    """Decorator: an exception in this rank is published so that the other ranks stop too."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BaseException as error:
            if _active is not None and not _active.failed and not isinstance(error, PeerFailed):
                _active.publish_failure(_describe(error), _exit_code(error))
            raise
    return wrapper


# ---------------------------------------------------------------------------------------------------------
# fastppl eval --nproc N: torchrun on this machine

def is_nproc_option(token: str) -> bool:
    """--nproc, --nproc=N, and the abbreviations argparse accepts for it (--npr ...)."""
    option = token.split("=", 1)[0]
    return len(option) >= 3 and "--nproc".startswith(option)


def without_nproc(argv: Sequence[str]) -> list[str]:
    """argv less its --nproc option, so that the relaunched command runs as one rank."""
    out, skip_value = [], False
    for token in argv:
        if skip_value:
            skip_value = False
        elif is_nproc_option(token):
            skip_value = "=" not in token
        else:
            out.append(token)
    return out


# under --nproc a rank other than 0 waits RANK_ERROR_DELAY_S before printing an error, so that an error every rank
# meets (bad input) is printed once, by rank 0, whose exit makes torchrun stop the others
RANK_ERROR_DELAY_S = 2.0


def torchrun_command(nproc: int, fastppl_argv: Sequence[str]) -> list[str]:
    # fastppl.launch: torchrun, less its failure report (see there); --standalone: a rendezvous on localhost with a
    # free port, so that several jobs can share a machine
    return [sys.executable, "-m", "fastppl.launch", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "fastppl", *fastppl_argv]


def relaunch_under_torchrun(nproc: int, argv: Sequence[str]) -> int:
    """Run `fastppl <argv>` as nproc ranks on this machine; the first failed rank's exit status is ours.

    torchrun runs in a session of its own, and SIGINT, SIGTERM and SIGHUP reach it from here, once: a Ctrl-C that
    reached every process of the terminal's group would be answered by each. Interrupted, the ranks stop
    silently (fastppl.launch) and KeyboardInterrupt is raised here, for the CLI's one line."""
    if launch_env() is not None:
        raise FastpplError("--nproc starts torchrun itself; drop it when the command already runs under torchrun")
    from .launch import RELAUNCHED_ENV, shell_status   # not at the top: `python -m fastppl.launch` imports this
    env = dict(os.environ, **{RELAUNCHED_ENV: "1"})
    env.setdefault("OMP_NUM_THREADS", "1")   # what torchrun sets for several ranks, without its five-line banner
    launcher = subprocess.Popen(torchrun_command(nproc, without_nproc(argv)), env=env, start_new_session=True)
    received = []

    def forward(signum, frame):
        received.append(signum)
        launcher.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        returncode = launcher.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received and received[0] == signal.SIGINT:
        raise KeyboardInterrupt
    return 128 + received[0] if received else shell_status(returncode)


def delay_a_ranks_error() -> None:
    """Under --nproc, a rank other than 0 waits before printing its error: see RANK_ERROR_DELAY_S."""
    from .launch import is_rank_under_nproc
    if is_rank_under_nproc() and os.environ.get("RANK", "0") != "0":
        time.sleep(RANK_ERROR_DELAY_S)
