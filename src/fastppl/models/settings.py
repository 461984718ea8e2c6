"""The check of the sizes and factors a model is built from, shared by every reader of a checkpoint's settings
(config.json, GGUF metadata): a size of 0 (a division by it), a fraction of a head or a RoPE base of inf (every
score nan) is one line naming the setting and its file, before anything is built."""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from ..errors import FastpplError


def check_sizes_and_factors(settings: Mapping[str, Any], sizes: Iterable[str], factors: Iterable[str], where: str,
                            fix: str) -> None:
    """Each of `sizes` that settings holds a positive whole number, each of `factors` a positive finite number
    (None, or a key absent: the reader's default). `where` opens the message ("PATH: GGUF metadata"), `fix` ends it."""
    for key in sizes:
        value = settings.get(key)
        if value is not None and (type(value) is not int or value < 1):   # bool is no size
            raise FastpplError(f"{where} {key} is {value!r}, not a positive whole number; {fix}")
    for key in factors:
        value = settings.get(key)
        if value is not None and (type(value) not in (int, float) or not 0 < value < math.inf):   # nan fails too
            raise FastpplError(f"{where} {key} is {value!r}, not a positive finite number; {fix}")


def with_nested_keys(config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's settings with those of its objects one level down as "object.key" too ("rope_scaling.factor"),
    so that a family names a nested setting as it names a top-level one."""
    flat = dict(config)
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update({f"{key}.{inner}": inner_value for inner, inner_value in value.items()})
    return flat
