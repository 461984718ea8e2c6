"""Output files: checked before a run, written atomically (no partial files)."""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Callable, Optional

from ..errors import FastpplError, is_link_loop


def written_in_place(path: str) -> bool:
    """Whether an output goes straight into path instead of a renamed temporary file: devices, FIFOs and
    anything under /dev or /proc (/dev/stdout, whether it leads to a terminal, a pipe or a file), which a
    rename would replace by a regular file."""
    target = Path(path).expanduser()
    real = Path(os.path.realpath(target))
    special = lambda p: p.exists() and not p.is_file() and not p.is_dir()  # noqa: E731
    return special(target) or special(real) or str(target).startswith(("/dev/", "/proc/"))


def files_in(directory) -> list[str]:
    """The files directly inside a local directory (none if it is not one): inputs a run reads from a model,
    tokenizer or data directory, which no output may replace."""
    path = Path(directory).expanduser() if directory else None
    return [str(p) for p in path.iterdir() if p.is_file()] if path is not None and path.is_dir() else []


def check_distinct_outputs(outputs: dict, inputs=(), output_dirs: dict = None) -> None:
    """Output paths ({flag: path or None}) must be non-empty, name different files, and not name an input
    file or a file inside an input directory: a report written over the corpus it scored would destroy it.
    output_dirs ({flag: directory or None}, e.g. --resume) are written too: they must not be, or lie inside, an
    input, and no output file may lie inside them."""
    seen = {}
    input_paths = [Path(p).expanduser().resolve() for p in inputs if p and Path(p).expanduser().exists()]

    def inside(path: Path, source: Path) -> bool:
        return path == source or (source.is_dir() and path.is_relative_to(source))

    def resolved(flag: str, path: str) -> Path:
        try:
            return Path(path).expanduser().resolve()
        except (RuntimeError, OSError):   # what resolve() raises on a loop of symbolic links
            raise FastpplError(f"{flag} {path}: is a loop of symbolic links; pick another path") from None

    directories = {}
    for flag, directory in (output_dirs or {}).items():
        if directory is None:
            continue
        resolved_dir = resolved(flag, directory)
        for source in input_paths:
            if inside(resolved_dir, source) or resolved_dir in source.parents:
                raise FastpplError(f"{flag} {directory}: holds or lies inside input {source} of this run; pick "
                                   "a directory of its own")
        directories[resolved_dir] = flag
    for flag, path in outputs.items():
        if path is None:
            continue
        if not path.strip():
            raise FastpplError(f"{flag}: empty path; give a file path or leave {flag} out")
        if written_in_place(path):
            continue   # /dev/stdout, /dev/null: several outputs may share them
        resolved_path = resolved(flag, path)
        for source in input_paths:
            if inside(resolved_path, source):
                raise FastpplError(f"{flag} {path}: would overwrite input {source} of this run; pick another "
                                   "output path")
        for directory, dir_flag in directories.items():
            if resolved_path == directory or directory in resolved_path.parents:
                raise FastpplError(f"{flag} {path}: is or lies inside {dir_flag} {directory}, which this run writes; "
                                   "pick another output path")
        if resolved_path in seen:
            raise FastpplError(f"{flag} {path}: the same file as {seen[resolved_path]}; give each output its own path")
        seen[resolved_path] = flag


def temporary_name_pattern(target: Path) -> re.Pattern:
    """The names write_atomic's temporary files of target have: mkstemp's prefix and 8 random characters."""
    return re.compile(re.escape("." + target.name + ".") + r"[a-z0-9_]{8}")


def remove_stale_temporaries(path) -> None:
    """Remove the temporary files of path that a process killed while writing it left behind (a rename that
    never came); a run started afterwards calls this before it writes path."""
    target = Path(os.path.realpath(Path(path).expanduser()))
    if not target.parent.is_dir():
        return
    pattern = temporary_name_pattern(target)
    for entry in os.scandir(target.parent):
        if pattern.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def check_writable(path: str, flag: str) -> None:
    """Fail before any work if an output file cannot be written. Creating a file is the only reliable
    test: os.access says yes to root on read-only and pseudo filesystems. Temporary files of path that a killed
    run left are removed."""
    if path == "-":   # would quietly make a file named "-"
        raise FastpplError(f"{flag} -: outputs go to files (stdout carries the summary); give a file path, "
                           "e.g. /dev/stdout")
    target = Path(path).expanduser()
    if target.is_dir() or str(path).endswith(("/", os.sep)):   # Path() drops a trailing slash
        raise FastpplError(f"{flag} {path}: is a directory; give a file path")
    if written_in_place(path):
        if not target.exists():
            raise FastpplError(f"{flag} {path}: no such device or file; pick another path")
        if not os.access(target, os.W_OK):
            raise FastpplError(f"{flag} {path}: cannot be written; pick another path")
        return
    parent = Path(os.path.realpath(target)).parent   # where write_atomic puts its temporary file
    if parent.exists() and not parent.is_dir():
        raise FastpplError(f"{flag} {path}: {parent} is a file, not a directory; pick another path")
    if is_link_loop(parent):
        raise FastpplError(f"{flag} {path}: {parent} is a loop of symbolic links; pick another path")
    if not parent.is_dir():
        raise FastpplError(f"{flag} {path}: directory {parent} does not exist; create it or pick another path")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix="." + target.name + ".")
    except OSError as e:
        raise FastpplError(f"{flag} {path}: cannot create files in {parent} ({e.strerror}); "
                           "pick another path") from None
    os.close(fd)
    os.unlink(probe)
    remove_stale_temporaries(path)


def _new_file_mode() -> int:
    """The mode open() gives a new file: 0666 less the umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


# (temporary file, target) pairs that write_atomic staged inside all_or_nothing(); None outside it
_staged: Optional[list] = None


@contextlib.contextmanager
def all_or_nothing():
    """Inside the block, write_atomic writes each file beside its target and renames them all into place when the
    block ends without error; if any write fails, none is renamed: a run's output files appear together or not
    at all (a --json that cannot be written leaves no --per-token file behind)."""
    global _staged
    outer, _staged = _staged, []
    try:
        yield
        for i, (tmp, target) in enumerate(_staged):
            try:
                os.replace(tmp, target)
            except OSError as e:
                raise FastpplError(f"cannot write {target} ({e.strerror or e})") from None
            _staged[i] = (None, target)
    finally:
        for tmp, _ in _staged:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
        _staged = outer


def write_atomic(path: str, write: Callable, binary: bool = False) -> None:
    """write(file) into a temporary file beside path, then rename it into place; on any failure
    nothing is left behind, and an OS error is a one-line FastpplError. A device or FIFO (/dev/stdout) is
    written in place (written_in_place): renaming over it would replace the device with a regular file. A
    symlink is followed: the file it points to is replaced, not the link."""
    if written_in_place(path):
        try:
            with open(Path(path).expanduser(), "wb" if binary else "w") as f:
                write(f)
        except OSError as e:
            raise FastpplError(f"cannot write {path} ({e.strerror or e})") from None
        return
    target = Path(os.path.realpath(Path(path).expanduser()))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix="." + target.name + ".")
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
        os.chmod(tmp, _new_file_mode())   # mkstemp's 0600 would hide the report from the group
        if _staged is not None:
            _staged.append((tmp, target))   # renamed when all_or_nothing's block ends
            return
        os.replace(tmp, target)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise FastpplError(f"cannot write {path} ({e.strerror or e}); nothing was written") from None
        raise


def finite_or_null(value):
    """value with every NaN or infinite float replaced by None (recursively through dicts, lists and tuples):
    JSON has no NaN, and strict parsers (JavaScript's, Go's, serde_json) refuse the bare NaN that Python writes."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value


def write_json(path: str, result: dict) -> None:
    write_atomic(path, lambda f: (json.dump(finite_or_null(result), f, indent=2, allow_nan=False), f.write("\n")))


def write_jsonl(path: str, records) -> None:
    write_atomic(path, lambda f: f.writelines(json.dumps(finite_or_null(r), allow_nan=False) + "\n" for r in records))


def write_npy(path: str, array) -> None:
    import numpy as np
    write_atomic(path, lambda f: np.save(f, array), binary=True)
