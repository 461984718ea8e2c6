"""User-facing errors: one line that names the problem and what to do; the CLI exits 2 on them."""
import errno
import os
import re
import socket
import stat
from typing import Optional


def is_out_of_memory(error: BaseException) -> bool:
    """A device out-of-memory error (torch.OutOfMemoryError, or a kernel's own message saying so)."""
    return type(error).__name__ == "OutOfMemoryError" or "out of memory" in str(error).lower()


def is_memory_exhausted(error: BaseException) -> bool:
    """Out of device or host memory: a MemoryError, a device's out-of-memory error, or the CPU allocator's."""
    return isinstance(error, MemoryError) or isinstance(error, RuntimeError) and (
        is_out_of_memory(error) or "can't allocate memory" in str(error))


class FastpplError(Exception):
    """Bad input or configuration. The message is shown to the user as is, without a traceback."""


def first_line(error: BaseException, limit: int = 200) -> str:
    """The first line of an error's message (its type name when it has none), at most limit characters:
    what a one-line FastpplError quotes of a library's exception."""
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:limit]


def is_link_loop(path) -> bool:
    """Whether path leads through a loop of symbolic links (which pathlib's exists() reads as missing)."""
    try:
        os.stat(os.path.expanduser(path))
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


def no_such(path, what: str = "file") -> str:
    """Why path is not there, for a one-line error: "no such file", or that it is a loop of symbolic links."""
    return f"is a loop of symbolic links, not a {what}" if is_link_loop(path) else f"no such {what}"


def _not_regular(mode: int) -> str:
    """What a file that is not a regular file is, for a one-line error."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    return "a socket" if stat.S_ISSOCK(mode) else "a device"


def check_input_file(path, fix: str) -> None:
    """Refuses, in one line naming path and ending in `fix`, an input that is missing or not a regular file
    (before anything opens it): open() of a FIFO waits for a writer that may never come, and a device or a
    socket has no end to read to."""
    try:
        mode = os.stat(os.path.expanduser(path)).st_mode
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            raise FastpplError(f"{path}: {no_such(path)}; {fix}") from None
        raise FastpplError(f"{path}: cannot be read ({e.strerror or e}); {fix}") from None
    if not stat.S_ISREG(mode):
        raise FastpplError(f"{path}: is {_not_regular(mode)}, not a regular file; {fix}")


def check_directory_members(directory, fix: str) -> None:
    """Refuses a FIFO, device or socket directly inside `directory` (a checkpoint's or a tokenizer's), which a
    loader, fastppl's or transformers', might open and wait on; links are followed, to what they lead to."""
    try:
        entries = list(os.scandir(os.path.expanduser(directory)))
    except OSError:
        return   # the loader's own check names an unreadable directory
    for entry in entries:
        try:
            mode = os.stat(entry.path).st_mode
        except OSError:   # a broken link: refused by whoever needs the file, ignored otherwise
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise FastpplError(f"{entry.path}: is {_not_regular(mode)}, not a regular file; {fix}")


_ALLOCATION = re.compile(r"allocate\s+(\d+(?:\.\d+)?)\s*(bytes|[KMGTPE]i?B)?", re.IGNORECASE)


def allocation_gib(error: BaseException) -> Optional[float]:
    """The size of the allocation an out-of-memory error names, in GiB (torch's CUDA and CPU allocators and numpy
    say "allocate 465.66 GiB", "allocate 500000000000000 bytes", "allocate 3.64 TiB"); None if it names none."""
    found = _ALLOCATION.search(str(error))
    if found is None:
        return None
    unit = (found.group(2) or "bytes").upper().replace("I", "")
    scale = {"BYTES": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40, "PB": 2**50, "EB": 2**60}[unit]
    return float(found.group(1)) * scale / 2**30


# the hub's and the HTTP clients' names for "could not get there" (huggingface_hub, httpx, requests, urllib3)
_UNREACHABLE_NAMES = ("ConnectError", "ConnectionError", "ConnectTimeout", "Timeout", "OfflineModeIsEnabled",
                      "LocalEntryNotFoundError", "NameResolutionError", "MaxRetryError", "NetworkError")


class Unreachable(FastpplError):
    """A download whose server could not be reached (offline), as opposed to one that answered no."""


def is_unreachable(error: BaseException) -> bool:
    """Whether error, or an error it was raised from, says the network or the server could not be reached."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (socket.gaierror, socket.timeout, ConnectionError, TimeoutError)):
            return True
        if any(name in cls.__name__ for cls in type(error).__mro__ for name in _UNREACHABLE_NAMES):
            return True
        if isinstance(getattr(error, "reason", None), BaseException):   # urllib's URLError wraps the socket's
            error = error.reason
            continue
        error = error.__cause__ or error.__context__
    return False
