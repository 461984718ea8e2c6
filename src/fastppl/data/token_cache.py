"""The on-disk token cache: one file per (tokenizer, text), verified on every read.

An entry is a one-line JSON header, padded with spaces to a multiple of 64 bytes, then the ids as raw
little-endian integers:

    {"format": "fastppl tokens 1", "tokenizer": FINGERPRINT, "text_sha256": ..., "count": N, "dtype": "<i4",
     "ids_sha256": SHA256 OF THE ID BYTES}

A read checks every field and the file's length, then hashes the ids (memory-mapped, not copied) against
ids_sha256. An entry that does not verify is never used: the caller tokenises again, with one warning line, and
rewrites it. An unreadable or read-only cache directory only costs the time of tokenising."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

FORMAT = "fastppl tokens 1"
HEADER_ALIGN = 64
MAX_HEADER_BYTES = 4096
MMAP_BYTES = 1 << 20   # entries from this size on are memory-mapped, not read into a buffer


def warn(message: str) -> None:
    print(f"fastppl: warning: {message}", file=sys.stderr)


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


def entry_path(root: Path, fingerprint: str, text_digest: str) -> Path:
    return root / "tokens" / f"{fingerprint}-{text_digest[:24]}.tokens"


def _header(fingerprint: str, text_digest: str, ids: np.ndarray) -> bytes:
    fields = {"format": FORMAT, "tokenizer": fingerprint, "text_sha256": text_digest, "count": int(ids.size),
              "dtype": ids.dtype.str, "ids_sha256": hashlib.sha256(ids.data).hexdigest()}
    line = json.dumps(fields).encode()
    padded = -(-(len(line) + 1) // HEADER_ALIGN) * HEADER_ALIGN
    return line + b" " * (padded - len(line) - 1) + b"\n"


def write_entry(path: Path, fingerprint: str, text_digest: str, ids: np.ndarray, vocab_size: int) -> None:
    """Written beside its place and renamed, so a reader never sees half an entry."""
    ids = ids.astype("<i4" if vocab_size < 2**31 else "<i8")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_header(fingerprint, text_digest, ids))
                f.write(ids.data)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:
        pass  # a read-only or full cache only costs speed


def _problem(header: dict, fingerprint: str, text_digest: str, file_bytes: int, header_bytes: int) -> Optional[str]:
    """Why a header does not describe this entry (None: it does)."""
    if header.get("format") != FORMAT:
        return "unknown format"
    if header.get("tokenizer") != fingerprint or header.get("text_sha256") != text_digest:
        return "made for another tokenizer or text"
    if header.get("dtype") not in ("<i4", "<i8") or not isinstance(header.get("count"), int) or header["count"] < 0:
        return "a damaged header"
    if file_bytes != header_bytes + header["count"] * np.dtype(header["dtype"]).itemsize:
        return f"its length does not match its {header['count']:,} ids"
    return None


def _read_ids(path: Path, fingerprint: str, text_digest: str) -> np.ndarray:
    """The entry's ids (int64), or ValueError/OSError saying why it cannot be used."""
    with open(path, "rb") as f:
        first = f.read(MAX_HEADER_BYTES)
        end = first.find(b"\n")
        if end < 0:
            raise ValueError("no header")
        header = json.loads(first[:end])   # ValueError when damaged
        if not isinstance(header, dict):
            raise ValueError("a damaged header")
        file_bytes = os.fstat(f.fileno()).st_size
        problem = _problem(header, fingerprint, text_digest, file_bytes, end + 1)
        if problem:
            raise ValueError(problem)
        count, dtype = header["count"], np.dtype(header["dtype"])
        if count == 0:
            ids = np.zeros(0, dtype)
        elif file_bytes >= MMAP_BYTES:
            ids = np.memmap(f, dtype=dtype, mode="r", offset=end + 1, shape=(count,))
        else:
            f.seek(end + 1)
            ids = np.frombuffer(f.read(), dtype=dtype)
    if hashlib.sha256(ids.data).hexdigest() != header.get("ids_sha256"):
        raise ValueError("its ids do not match their checksum")
    return ids.astype(np.int64)


def read_entry(path: Path, fingerprint: str, text_digest: str) -> Optional[np.ndarray]:
    """The entry's verified ids; None when there is none, or (with one warning line) when it does not verify."""
    try:
        if not path.is_file():
            return None
        return _read_ids(path, fingerprint, text_digest)
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        warn(f"token cache entry {path} cannot be used ({reason}); tokenising again")
        return None
