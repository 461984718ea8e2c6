"""The header of a GGUF file (llama.cpp's format, versions 2 and 3): metadata and tensor table, every offset checked
against the file; no tensor data read. Ours, not the gguf package's GGUFReader, which builds an object per
vocabulary entry and took 23 s on a 135M model's file where this takes a fraction of a second.

Layout (little-endian): "GGUF", version u32, tensor count u64, metadata count u64; each metadata entry a string
key, a type u32 and a value; each tensor a string name, n_dims u32, dims u64 (innermost first), type u32, offset
u64 from the data section, which starts at the next multiple of general.alignment (32) after the table."""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import FastpplError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]   # torch's order: outermost first
    type_id: int             # a GGMLQuantizationType
    offset: int              # in the file
    data_offset: int         # in the data section, as the table gives it


class _Truncated(Exception):
    pass


class _Cursor:
    def __init__(self, data):
        self.data, self.pos = data, 0

    def unpack(self, form: str):
        size = struct.calcsize(form)
        if self.pos + size > len(self.data):
            raise _Truncated
        value = struct.unpack_from(form, self.data, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        if self.pos + length > len(self.data):
            raise _Truncated
        text = bytes(self.data[self.pos:self.pos + length]).decode("utf-8", errors="replace")
        self.pos += length
        return text

    def value(self, type_id: int, keep_strings: bool):
        if type_id in _SCALARS:
            return self.unpack(_SCALARS[type_id])
        if type_id == _STRING:
            return self.string()
        if type_id != _ARRAY:
            raise ValueError(f"a metadata value of unknown type {type_id}")
        element_type, count = self.unpack("<I"), self.unpack("<Q")
        if element_type in _SCALARS:
            size = struct.calcsize(_SCALARS[element_type]) * count
            if self.pos + size > len(self.data):
                raise _Truncated
            values = list(struct.unpack_from(f"<{count}{_SCALARS[element_type][1]}", self.data, self.pos))
            self.pos += size
            return values
        if element_type != _STRING:
            raise ValueError(f"a metadata array of type {element_type}")
        if keep_strings:
            return [self.string() for _ in range(count)]
        for _ in range(count):   # variable length: walked, not decoded
            length = self.unpack("<Q")
            self.pos += length
        return count


def read_header(path: Path, keep_string_arrays: tuple[str, ...] = ()) -> tuple[dict, list[GGUFTensorInfo]]:
    """(metadata, tensors) of a GGUF file; string arrays other than those named are given as their length."""
    with open(path, "rb") as handle:
        try:
            data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:   # an empty file
            data = b""
    try:
        return _parse(data, path, keep_string_arrays)
    except _Truncated:
        raise FastpplError(f"{path}: ends inside its GGUF header; the file is truncated, download it again") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise FastpplError(f"{path}: is not a readable GGUF file ({e}); the file is corrupt, "
                           "download it again") from None
    finally:
        if isinstance(data, mmap.mmap):
            data.close()


def _parse(data, path: Path, keep_string_arrays) -> tuple[dict, list[GGUFTensorInfo]]:
    cursor = _Cursor(data)
    if bytes(data[:4]) != b"GGUF":
        raise FastpplError(f"{path}: is not a GGUF file (it does not start with the GGUF magic bytes); pass a .gguf "
                           "file written by llama.cpp's tools")
    cursor.pos = 4
    version, n_tensors, n_metadata = cursor.unpack("<I"), cursor.unpack("<Q"), cursor.unpack("<Q")
    if version not in (2, 3):
        raise FastpplError(f"{path}: is GGUF version {version}; fastppl reads versions 2 and 3")
    metadata = {}
    for _ in range(n_metadata):
        key = cursor.string()
        if key in metadata:   # llama.cpp refuses a file with two: which one holds is not defined
            raise ValueError(f"metadata key {key} appears twice")
        metadata[key] = cursor.value(cursor.unpack("<I"), key in keep_string_arrays)
    entries = {}
    for _ in range(n_tensors):
        name, n_dims = cursor.string(), cursor.unpack("<I")
        if n_dims > _MAX_DIMS:
            raise ValueError(f"tensor {name} has {n_dims} dimensions")
        if name in entries:
            raise ValueError(f"tensor {name} appears twice")
        dims = [cursor.unpack("<Q") for _ in range(n_dims)]
        entries[name] = (tuple(reversed(dims)), cursor.unpack("<I"), cursor.unpack("<Q"))
    alignment = metadata.get("general.alignment", 32)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):   # a power of two, as llama.cpp
        raise ValueError(f"general.alignment {alignment!r} is no power of two")
    data_start = -(-cursor.pos // alignment) * alignment
    return metadata, [GGUFTensorInfo(name, shape, type_id, data_start + offset, offset)
                      for name, (shape, type_id, offset) in entries.items()]
