"""Checkpoint tensors read into a model built on the meta device, on the run's device and in its dtype, so that
loading holds the model once (not the file, an fp32 copy and the model).

On the CPU each tensor is read on its own: the file's bytes go straight into the parameter where layouts agree,
else through one buffer the size of one tensor. Onto a GPU the bytes stream through a small ring of pinned staging
buffers: threads read the next buffers from the files (os.preadv releases the GIL) while a copy stream moves the
last one to the GPU, where each tensor is converted to the run's dtype. The host then holds the ring, not the
model, and reading, copying and converting overlap.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple, Optional

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
    # a quantized tensor (GGUF): its stored_bytes, turned into the values (dtype, shape) on the device they are on
    decode: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    stored_bytes: int = 0

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


def read_tensor(stored: StoredTensor, handle=None, device: torch.device | str = "cpu") -> torch.Tensor:
    """The stored tensor in its own dtype, on the CPU (a quantized one: decoded on `device`)."""
    if stored.tensor is not None:
        return stored.tensor
    if handle is None:
        with open(stored.file, "rb", buffering=0) as handle:
            return read_tensor(stored, handle, device)
    if stored.decode is not None:
        raw = _read_bytes(handle, stored, torch.empty(stored.stored_bytes, dtype=torch.uint8))
        return stored.decode(raw.to(device))
    return _read_bytes(handle, stored, torch.empty(stored.shape, dtype=stored.dtype))


def _copy_converted(source: torch.Tensor, destination: torch.Tensor, transpose: bool) -> None:
    """destination <- source (on destination's device), converted to destination's dtype as the fp32 route does."""
    if source.dtype not in _EXACT_IN_FP32:
        source = source.float()
    destination.copy_(source.t() if transpose else source)


def _read_into(handle, stored: StoredTensor, destination: torch.Tensor, transpose: bool) -> None:
    """destination <- the stored tensor, converted to destination's dtype on destination's device."""
    direct = (stored.tensor is None and stored.decode is None and not transpose and destination.device.type == "cpu"
              and destination.dtype == stored.dtype and destination.is_contiguous())
    if direct:
        _read_bytes(handle, stored, destination)
        return
    _copy_converted(read_tensor(stored, handle, destination.device).to(destination.device), destination, transpose)


class StoredBlock:
    """One block's checkpoint tensors kept on a device in their stored form (a GGUF or compressed-tensors block:
    its quantized bytes), turned into the block's parameters on demand (fastppl.engine.streamed), by the same
    decoding and conversion as loading does, so that the values are the loaded model's bit for bit."""

    rests_in = "the {device} device in their stored (quantized) form, decoded a block at a time"

    def __init__(self, pieces: list[tuple[StoredTensor, Piece]], device: torch.device):
        self.items = []
        for stored, piece in sorted(pieces, key=lambda p: (str(p[0].file), p[0].offset)):
            with open(stored.file, "rb", buffering=0) as handle:
                raw = _read_bytes(handle, stored, torch.empty(stored.stored_bytes, dtype=torch.uint8)) \
                    if stored.decode is not None else read_tensor(stored, handle)
            self.items.append((raw.to(device), stored, piece))
        self.stored_bytes = sum(raw.numel() * raw.element_size() for raw, _, _ in self.items)

    def stored_tensors(self) -> list[torch.Tensor]:
        return [raw for raw, _, _ in self.items]

    def fill(self, parameters: dict[str, torch.Tensor]) -> None:
        """parameters: the block's, by their names within it."""
        for raw, stored, piece in self.items:
            values = stored.decode(raw) if stored.decode is not None else raw
            _copy_converted(values, _rows(parameters[piece.parameter], piece), piece.transpose)


class FileBlock:
    """One block's checkpoint tensors left in their files, for a host whose memory cannot hold the blocks: read
    into the block's parameters on demand (through the page cache), converted as loading converts them."""
    rests_in = "the checkpoint's files (host memory is short of the blocks: read a block at a time)"
    stored_bytes = 0   # nothing kept on the device
    reads_files = True   # the host reads each block when its turn comes (fastppl.engine.streamed)

    def __init__(self, pieces: list[tuple[StoredTensor, Piece]], device: torch.device):
        self.items = sorted(pieces, key=lambda p: (str(p[0].file), p[0].offset))

    def stored_tensors(self) -> Iterator[torch.Tensor]:
        """Read from the files one at a time (a weights digest, once a run)."""
        return (read_tensor(stored) for stored, _ in self.items)

    def fill(self, parameters: dict[str, torch.Tensor]) -> None:
        for stored, piece in self.items:
            try:
                with open(stored.file, "rb", buffering=0) as handle:
                    _read_into(handle, stored, _rows(parameters[piece.parameter], piece), piece.transpose)
            except OSError as error:   # the file moved or went during the run
                raise FastpplError(f"{stored.file}: could not be read during the run ({first_line(error)}); the "
                                   "checkpoint's blocks are read from it a block at a time: keep it in place") from None


def stored_blocks(pieces: list[tuple[StoredTensor, Piece]], n_layer: int, device: torch.device,
                  kind: type = StoredBlock) -> tuple[list, list[tuple[StoredTensor, Piece]]]:
    """The pieces of each block ("blocks.{i}.*", renamed within the block) as StoredBlocks on the device (or
    FileBlocks), and the pieces of the rest of the model."""
    by_layer: list[list] = [[] for _ in range(n_layer)]
    rest = []
    for stored, piece in pieces:
        match = re.match(r"blocks\.(\d+)\.(.+)", piece.parameter)
        if match is None:
            rest.append((stored, piece))
        else:
            by_layer[int(match.group(1))].append((stored, piece._replace(parameter=match.group(2))))
    return [kind(block, device) for block in by_layer], rest


@dataclass(frozen=True)
class Staging:
    """How tensors stream to the device: a ring of n_buffers host buffers of buffer_bytes (pinned for a GPU),
    filled by n_threads readers in reads of at most read_bytes. The host holds the ring, not the model."""
    buffer_bytes: int = 256 << 20
    n_buffers: int = 4
    n_threads: int = 8
    read_bytes: int = 16 << 20
    pinned: bool = True


def default_staging(device: torch.device, pieces: list[tuple[StoredTensor, Piece]]) -> Optional[Staging]:
    """Staging onto a GPU from safetensors files (FASTPPL_STAGED_LOAD=0 turns it off, to compare or bisect); None
    (a tensor at a time) otherwise: with it off, on the CPU, whose parameters take the file's bytes
    directly, for .bin files (memory-mapped tensors), quantized tensors (decoded one at a time on the device) or
    where os.preadv is missing."""
    if os.environ.get("FASTPPL_STAGED_LOAD") == "0" or device.type != "cuda" or not hasattr(os, "preadv") or \
            any(s.tensor is not None or s.decode is not None for s, _ in pieces):
        return None
    return Staging(n_threads=min(Staging.n_threads, os.cpu_count() or 1))


def fill_parameters(model: nn.Module, pieces: list[tuple[StoredTensor, Piece]],
                    staging: Optional[Staging] = None) -> None:
    """Every parameter of `model` (allocated, uninitialised, on its device and in its dtype) from the checkpoint,
    file by file, each in the order of its bytes: through `staging` (by default default_staging's), else a tensor
    at a time, one open file at a time. Both give the same weights, bit for bit."""
    parameters = dict(model.named_parameters())
    in_file_order = sorted(pieces, key=lambda p: (str(p[0].file), p[0].offset))
    destinations = [_rows(parameters[piece.parameter], piece) for _, piece in in_file_order]
    device = destinations[0].device if destinations else torch.device("cpu")
    staging = staging or default_staging(device, pieces)
    with torch.no_grad():
        if staging is None:
            _fill_one_at_a_time(in_file_order, destinations)
        else:
            _fill_staged(in_file_order, destinations, staging)
    rows_filled = {name: 0 for name in parameters}
    for _, piece in in_file_order:
        rows_filled[piece.parameter] += piece.stop - piece.start
    unfilled = [name for name, p in parameters.items() if rows_filled[name] != (p.shape[0] if p.dim() else 1)]
    assert not unfilled, f"parameters the checkpoint map does not fill: {unfilled[:3]}"


def _rows(parameter: torch.Tensor, piece: Piece) -> torch.Tensor:
    return parameter[piece.start:piece.stop] if parameter.dim() else parameter


def _fill_one_at_a_time(items: list[tuple[StoredTensor, Piece]], destinations: list[torch.Tensor]) -> None:
    pairs = list(zip(items, destinations))
    for file, group in groupby(pairs, key=lambda pair: pair[0][0].file):
        with open(file, "rb", buffering=0) as handle:
            for (stored, piece), destination in group:
                _read_into(handle, stored, destination, piece.transpose)


class Chunk(NamedTuple):
    """Bytes [start, stop) of tensor `item` (of the read order), at buffer_offset in a staging buffer."""
    item: int
    start: int
    stop: int
    buffer_offset: int


def plan_fills(sizes: list[int], buffer_bytes: int) -> list[list[Chunk]]:
    """What each fill of a staging buffer holds: the tensors' bytes (sizes, in read order) back to back, a tensor
    split wherever a buffer ends, so that every fill but the last is full. Sizes 5, 2, 9 in 4-byte buffers:

        fill      0         1         2         3
        bytes  0 0 0 0 | 0 1 1 2 | 2 2 2 2 | 2 2 2 2     (the tensor each byte belongs to)
    """
    assert buffer_bytes > 0
    fills: list[list[Chunk]] = []
    current: list[Chunk] = []
    used = 0
    for item, size in enumerate(sizes):
        start = 0
        while True:
            take = min(size - start, buffer_bytes - used)
            current.append(Chunk(item, start, start + take, used))
            used, start = used + take, start + take
            if used == buffer_bytes:
                fills.append(current)
                current, used = [], 0
            if start == size:
                break
    if current:
        fills.append(current)
    return fills


def _fill_staged(items: list[tuple[StoredTensor, Piece]], destinations: list[torch.Tensor], staging: Staging) -> None:
    """Fill i goes to ring buffer i % n_buffers. Readers work up to n_buffers fills ahead; a buffer is read into
    again only once the copy stream has taken its last fill to the device; each tensor is converted there once its
    last bytes have landed."""
    fills = plan_fills([stored.n_bytes for stored, _ in items], staging.buffer_bytes)
    if not fills:
        return
    device = destinations[0].device
    copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    if copy_stream is not None:   # the parameters' memory may have been another tensor's, still in use there
        copy_stream.wait_stream(torch.cuda.current_stream(device))
    buffer_bytes = min(staging.buffer_bytes, sum(stored.n_bytes for stored, _ in items))
    ring = [torch.empty(max(buffer_bytes, 1), dtype=torch.uint8, pin_memory=staging.pinned and copy_stream is not None)
            for _ in range(min(staging.n_buffers, len(fills)))]
    descriptors = {stored.file: os.open(stored.file, os.O_RDONLY) for stored, _ in items}
    pool = ThreadPoolExecutor(staging.n_threads, thread_name_prefix="fastppl-read")
    landing: dict[int, tuple[torch.Tensor, bool]] = {}   # item -> (its bytes on the device, landed in place)
    try:
        reads = {i: _submit_fill(pool, descriptors, items, fills[i], ring[i], staging.read_bytes)
                 for i in range(len(ring))}
        for i, fill in enumerate(fills):
            slot = ring[i % len(ring)]
            for read in reads.pop(i):
                read.result()   # a file that ends early raises here
            with torch.cuda.stream(copy_stream) if copy_stream is not None else contextlib.nullcontext():
                finished = _copy_fill(fill, slot, items, destinations, landing)
                slot_copied = torch.cuda.Event() if copy_stream is not None else None
                if slot_copied is not None:
                    slot_copied.record(copy_stream)
                for item in finished:   # after the event: the next read into the slot need not wait for these
                    landed, in_place = landing.pop(item)
                    if not in_place:
                        stored, piece = items[item]
                        _copy_converted(landed.view(stored.dtype).reshape(stored.shape), destinations[item],
                                        piece.transpose)
            if i + len(ring) < len(fills):
                if slot_copied is not None:
                    slot_copied.synchronize()
                reads[i + len(ring)] = _submit_fill(pool, descriptors, items, fills[i + len(ring)], slot,
                                                    staging.read_bytes)
        if copy_stream is not None:
            copy_stream.synchronize()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)   # no read may still write into a buffer being freed
        for descriptor in descriptors.values():
            os.close(descriptor)


def _submit_fill(pool: ThreadPoolExecutor, descriptors: dict[Path, int], items: list[tuple[StoredTensor, Piece]],
                 fill: list[Chunk], buffer: torch.Tensor, read_bytes: int) -> list[Future]:
    """The fill's reads into `buffer`, in pieces of at most read_bytes so that every reader has work."""
    view = memoryview(buffer.numpy())
    reads = []
    for chunk in fill:
        stored = items[chunk.item][0]
        for begin in range(chunk.start, chunk.stop, read_bytes):
            end = min(begin + read_bytes, chunk.stop)
            at = chunk.buffer_offset + begin - chunk.start
            reads.append(pool.submit(_read_exactly, descriptors[stored.file], stored.file,
                                     view[at:at + end - begin], stored.offset + begin))
    return reads


def _read_exactly(descriptor: int, file: Path, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(descriptor, [view[done:]], offset + done)
        if not got:
            raise _corrupt(file, "it ends inside a tensor")
        done += got


def _copy_fill(fill: list[Chunk], buffer: torch.Tensor, items: list[tuple[StoredTensor, Piece]],
               destinations: list[torch.Tensor], landing: dict[int, tuple[torch.Tensor, bool]]) -> list[int]:
    """The fill's chunks from the staging buffer to their tensors' bytes on the device: the parameter's own where
    the layouts agree, else a buffer of the tensor in the file's dtype; the items whose last bytes it held."""
    finished = []
    for chunk in fill:
        stored, piece = items[chunk.item]
        if chunk.start == 0:
            destination = destinations[chunk.item]
            in_place = (not piece.transpose and destination.dtype == stored.dtype and destination.is_contiguous())
            landed = destination.reshape(-1).view(torch.uint8) if in_place else \
                torch.empty(stored.n_bytes, dtype=torch.uint8, device=destination.device)
            landing[chunk.item] = (landed, in_place)
        staged = buffer[chunk.buffer_offset:chunk.buffer_offset + chunk.stop - chunk.start]
        landing[chunk.item][0][chunk.start:chunk.stop].copy_(staged, non_blocking=True)
        if chunk.stop == stored.n_bytes:
            finished.append(chunk.item)
    return finished
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
