"""Checkpoint tensors read one at a time into a model built on the meta device, on the run's device and in its
dtype: the file's bytes go straight into the parameter where layouts agree, else through one buffer the size of
one tensor, so that loading holds the model once (not the file, an fp32 copy and the model)."""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Iterable, NamedTuple, Optional

import torch
import torch.nn as nn

from ..errors import FastpplError, first_line

# the safetensors names of the dtypes torch has
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                       "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
# widened to fp32 without rounding, so that converting them straight to the run's dtype rounds as the fp32 route
# does; any other dtype (fp64) goes through fp32 first, as torch's CPU casts do and another device's might not
_EXACT_IN_FP32 = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HEADER_BYTES = 100_000_000   # the safetensors library's own limit: a larger "header" is not one


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a checkpoint: where its bytes lie in a safetensors file, or (a .bin) the tensor itself,
    memory-mapped."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path
    offset: int = 0
    tensor: Optional[torch.Tensor] = None

    @property
    def n_bytes(self) -> int:
        return self.dtype.itemsize * _numel(self.shape)


class Piece(NamedTuple):
    """Where a checkpoint tensor goes: rows [start, stop) of a native parameter (fused q, k, v or gate, up are
    stacked along dim 0), transposed first where the checkpoint stores the matrix as (in, out)."""
    parameter: str
    start: int
    stop: int
    transpose: bool = False


def _numel(shape: Iterable[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _corrupt(file: Path, reason: str) -> FastpplError:
    return FastpplError(f"{file}: cannot be read as a checkpoint ({reason}); the file is corrupt or truncated, "
                        "download it again")


def safetensors_index(file: Path) -> dict[str, StoredTensor]:
    """The header of a safetensors file (8 bytes of little-endian length, then JSON): every tensor's dtype, shape
    and byte offset, checked against the file's size; no weight is read."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        header_length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        if not 0 < header_length <= min(size - 8, _MAX_HEADER_BYTES):
            raise _corrupt(file, "no safetensors header")
        try:
            header = json.loads(handle.read(header_length))
        except (ValueError, UnicodeDecodeError) as e:
            raise _corrupt(file, f"header: {first_line(e, 120)}") from None
    data_start, index = 8 + header_length, {}
    for name, entry in (header.items() if isinstance(header, dict) else [("", None)]):
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(offset) for offset in entry["data_offsets"])
            stored = StoredTensor(_SAFETENSORS_DTYPES[entry["dtype"]], tuple(int(s) for s in entry["shape"]),
                                  file, data_start + begin)
        except (KeyError, TypeError, ValueError):
            raise _corrupt(file, f"header entry {name!r}") from None
        if not 0 <= begin <= end <= size - data_start or end - begin != stored.n_bytes:
            raise _corrupt(file, f"the bytes of {name} do not fit its shape or the file")
        index[name] = stored
    return index


def _bin_index(file: Path) -> dict[str, StoredTensor]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        assert isinstance(state, dict)
        return {name: StoredTensor(t.dtype, tuple(t.shape), file, tensor=t) for name, t in state.items()}
    except Exception as e:   # unpickling raises many types for a damaged file
        raise _corrupt(file, first_line(e, 160)) from None


def index_checkpoint(files: list[Path]) -> dict[str, StoredTensor]:
    """{name: StoredTensor} over a checkpoint's files (safetensors: their headers; .bin: memory-mapped)."""
    index: dict[str, StoredTensor] = {}
    for file in files:
        index.update(safetensors_index(file) if file.suffix == ".safetensors" else _bin_index(file))
    return index


def _read_bytes(handle, stored: StoredTensor, destination: torch.Tensor) -> torch.Tensor:
    """The stored bytes into the (contiguous, CPU) destination, with no copy between."""
    view = memoryview(destination.reshape(-1).view(torch.uint8).numpy())
    handle.seek(stored.offset)
    done = 0
    while done < len(view):
        got = handle.readinto(view[done:])
        if not got:
            raise _corrupt(stored.file, "it ends inside a tensor")
        done += got
    return destination


def read_tensor(stored: StoredTensor, handle=None) -> torch.Tensor:
    """The stored tensor on the CPU in its own dtype."""
    if stored.tensor is not None:
        return stored.tensor
    if handle is None:
        with open(stored.file, "rb", buffering=0) as handle:
            return read_tensor(stored, handle)
    return _read_bytes(handle, stored, torch.empty(stored.shape, dtype=stored.dtype))


def _read_into(handle, stored: StoredTensor, destination: torch.Tensor, transpose: bool) -> None:
    """destination <- the stored tensor, converted to destination's dtype on destination's device."""
    direct = (stored.tensor is None and not transpose and destination.device.type == "cpu"
              and destination.dtype == stored.dtype and destination.is_contiguous())
    if direct:
        _read_bytes(handle, stored, destination)
        return
    source = read_tensor(stored, handle).to(destination.device)
    if source.dtype not in _EXACT_IN_FP32:
        source = source.float()
    destination.copy_(source.t() if transpose else source)


def fill_parameters(model: nn.Module, pieces: list[tuple[StoredTensor, Piece]]) -> None:
    """Every parameter of `model` (allocated, uninitialised, on its device and in its dtype) from the checkpoint:
    file by file, each in the order of its bytes, one open file at a time."""
    parameters = dict(model.named_parameters())
    rows_filled = {name: 0 for name in parameters}
    in_file_order = sorted(pieces, key=lambda p: (str(p[0].file), p[0].offset))
    with torch.no_grad():
        for file, group in groupby(in_file_order, key=lambda p: p[0].file):
            with open(file, "rb", buffering=0) as handle:
                for stored, piece in group:
                    target = parameters[piece.parameter]
                    destination = target[piece.start:piece.stop] if target.dim() else target
                    _read_into(handle, stored, destination, piece.transpose)
                    rows_filled[piece.parameter] += piece.stop - piece.start
    unfilled = [name for name, p in parameters.items() if rows_filled[name] != (p.shape[0] if p.dim() else 1)]
    assert not unfilled, f"parameters the checkpoint map does not fill: {unfilled[:3]}"


def refuse_dropped_weights(index: dict[str, StoredTensor], layer_prefix: str, n_layer: int, tied_head: Optional[str],
                           embedding: str, source: str) -> None:
    """Refuse a checkpoint whose weights the model would drop and so silently be another model: layers past
    the config's n_layer (a config with fewer layers than the file), or, for a tied model, a file's own output
    matrix that is not the embedding. Other extra tensors (a value head, a second copy of the weights under
    other names, as Mistral's consolidated.safetensors) are ignored, as transformers ignores them."""
    layer = re.compile(re.escape(layer_prefix) + r"(\d+)\.")
    extra = sorted((int(m.group(1)), k) for k in index if (m := layer.match(k)) and int(m.group(1)) >= n_layer)
    if extra:
        raise FastpplError(
            f"{source}: checkpoint holds layer {extra[0][0]} ({extra[0][1]}), but config.json has {n_layer} layers; "
            "the config does not match the file")
    if tied_head is not None and tied_head in index and embedding in index:
        head, table = index[tied_head], index[embedding]
        if head.shape != table.shape or not torch.equal(read_tensor(head), read_tensor(table)):
            raise FastpplError(
                f"{source}: {tied_head} differs from {embedding}, but config.json ties them (tie_word_embeddings); "
                "the config does not match the file")


def check_stored(stored: StoredTensor, shape: tuple, source: str, hf_name: str) -> None:
    """A checkpoint tensor holds weights of the shape the config implies."""
    if not stored.dtype.is_floating_point:   # a conversion would turn integers into weights silently
        raise FastpplError(f"{source}: {hf_name} holds {stored.dtype} values, not weights; the checkpoint is corrupt")
    if tuple(stored.shape) != tuple(shape):
        raise FastpplError(
            f"{source}: {hf_name} has shape {tuple(stored.shape)}, config.json implies "
            f"{tuple(shape)}; the checkpoint does not match its config"
        )
