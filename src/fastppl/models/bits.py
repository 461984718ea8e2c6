"""Bits per weight of a model's file: the bytes its tensors are stored in, times 8, over the number of weights they
hold. Read from the file's header (safetensors, GGUF) or its stored tensors' index; no weight is read.

- GGUF: every tensor's data bytes (its GGML type's blocks) over its values, as llama.cpp's loader prints "file
  size = ... (N BPW)" (llama-model-loader.cpp: the sum of ggml_nbytes over the sum of ggml_nelements); the
  header and the alignment padding are not counted.
- compressed-tensors (llm-compressor): every stored tensor's bytes (packed weights, scales, zero points) over the
  weights of the model they decode to (a quantized module's weight_shape, not its packed words).
- safetensors or .bin: each tensor's dtype: 16.0 for a bf16 checkpoint, 32.0 for fp32.

A random:PRESET model has no file, and so no bits per weight (None)."""
from __future__ import annotations

from typing import Iterable, Optional

from ..config import gguf_local_path, gguf_spec
from .compressed import compressed_index, is_compressed_tensors
from .gguf_file import read_header
from .gguf_quants import stored_bytes, supported_type
from .loading import RANDOM_PREFIX, _read_config, checkpoint_index, resolve_checkpoint_dir
from .weights import StoredTensor


def bits_per_weight(spec: str) -> Optional[float]:
    """The bits per weight of the file --model names; None for random:PRESET, which has none."""
    if spec.startswith(RANDOM_PREFIX):
        return None
    if gguf_spec(spec):
        return _gguf_bits(spec)
    directory = resolve_checkpoint_dir(spec)
    index, hf_config = checkpoint_index(directory), _read_config(directory)
    weights = compressed_index(index, hf_config, str(directory)) if is_compressed_tensors(hf_config) else index
    return 8 * sum(t.n_bytes for t in index.values()) / _count(weights.values())


def _gguf_bits(spec: str) -> float:
    path = gguf_local_path(spec)
    _, tensors = read_header(path)
    n_bytes = sum(stored_bytes(supported_type(t.type_id, t.name, str(path)), t.shape) for t in tensors)
    return 8 * n_bytes / sum(_numel(t.shape) for t in tensors)


def _count(tensors: Iterable[StoredTensor]) -> int:
    return sum(_numel(t.shape) for t in tensors)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
