"""What `fastppl compare` reads, checked before use: files of a bounded size that are not devices, and the
fields of a report that compare reads, each of a type it can use."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from ..config import MAX_BOOTSTRAP
from ..errors import FastpplError, check_input_file

# far beyond any report or per-document file fastppl writes (a million documents' lines are ~200 MB)
MAX_INPUT_BYTES = 2 << 30


def read_text(path: str, what: str) -> str:
    """A report's or per-document file's text: a regular file of at most MAX_INPUT_BYTES."""
    if Path(path).is_dir():
        raise FastpplError(f"{path}: is a directory; pass the {what}")
    check_input_file(path, f"pass the {what}")
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 16)   # a binary file (a sparse one of zeros) is refused before it is read whole
            size = os.fstat(f.fileno()).st_size
            if b"\0" not in raw and size <= MAX_INPUT_BYTES:
                raw += f.read()
        if b"\0" in raw:
            raise FastpplError(f"{path}: holds a NUL byte, so it is binary, not the {what}")
        if size > MAX_INPUT_BYTES:
            raise FastpplError(f"{path}: is larger than {MAX_INPUT_BYTES >> 30} GiB, more than fastppl writes; "
                               f"pass the {what}")
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise FastpplError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None


def is_number(value) -> bool:
    # an int beyond float64's range fails every float operation compare makes
    return isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**1023)


def is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63   # an int64


# the fields compare reads: a check each (absent optional fields are fine)
_FIELD_TYPES = {
    # reports write null where a value is not finite (ppl past float64's range, bits/byte with no bytes)
    "nll": is_number, "ppl": lambda v: v is None or is_number(v),
    "tokens_scored": is_count,
    "nll_sum": is_number,
    "nll_stderr": lambda v: v is None or is_number(v),
    "tokens_per_second": lambda v: v is None or is_number(v),
    "bits_per_byte": lambda v: v is None or is_number(v),
    "dtype": lambda v: isinstance(v, str),
    "environment": lambda v: isinstance(v, dict) and isinstance(v.get("device_name", ""), str),
    "per_doc_path": lambda v: v is None or isinstance(v, str),
    "nll_by_position": lambda v: v is None or (isinstance(v, list) and all(x is None or is_number(x) for x in v)),
    "nll_by_position_std": lambda v: v is None or (isinstance(v, list) and all(x is None or is_number(x) for x in v)),
    "tokens_by_position": lambda v: v is None or (isinstance(v, list) and all(is_count(x) for x in v)),
}
# eval --bootstrap's settings and the units it resampled, which compare resamples again for paired differences
_BOOTSTRAP_TYPES = {
    "level": lambda v: isinstance(v, float) and 0 < v < 1,
    "replicates": lambda v: is_count(v) and 0 < v <= MAX_BOOTSTRAP, "seed": is_count,
    "resampled": lambda v: isinstance(v, dict) and v.get("kind") in ("document", "window"),
}
_RESAMPLED_TYPES = {"index": is_count, "nll_sum": is_number, "tokens": lambda v: is_count(v) and v > 0,
                    "bytes": is_count}


def _bootstrap_wrongly_typed(boot) -> Optional[str]:
    if not isinstance(boot, dict):
        return "bootstrap"
    for field, check in _BOOTSTRAP_TYPES.items():
        if not check(boot.get(field)):
            return f"bootstrap.{field}"
    resampled = boot["resampled"]
    for field, check in _RESAMPLED_TYPES.items():
        values = resampled.get(field)
        # one number per unit: a list of numbers, as long as the others
        if not (isinstance(values, list) and len(values) == len(resampled.get("index", ()))
                and all(check(v) for v in values)):
            return f"bootstrap.resampled.{field}"
    return None


def wrongly_typed(result: dict) -> Optional[str]:
    """The first field compare reads whose value it could not use, or None."""
    for field, check in _FIELD_TYPES.items():
        if field in result and not check(result[field]):
            return field
    if result.get("bootstrap") is not None:
        wrong = _bootstrap_wrongly_typed(result["bootstrap"])
        if wrong:
            return wrong
    config = result["config"]
    data = config.get("data", [])
    if not (isinstance(data, list) and all(isinstance(d, str) for d in data)):
        return "config.data"
    for field in ("model", "split"):
        if not isinstance(config.get(field, ""), str):
            return f"config.{field}"
    return None
