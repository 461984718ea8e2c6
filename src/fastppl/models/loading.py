"""Resolve --model: random:<preset>, a local Hugging Face checkpoint directory, or a hub id."""
from __future__ import annotations

import json
import re
import os
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from ..config import gguf_spec, is_path_like
from ..errors import (FastpplError, Unreachable, check_directory_members, first_line, is_link_loop, is_unreachable,
                      no_such)
from .compressed import compressed_index, is_compressed_tensors
from .gguf import load_hf_gguf, open_gguf
from .gpt2 import GPT2, PRESETS
from .hf_backend import HFCausalLM
from .registry import ModelSpec, NotNative, native_model_types, presets, spec_for_model_type, spec_of, spec_of_preset
from .settings import check_sizes_and_factors, with_nested_keys
from .hf_offload import meta_model, offload_device_map, offload_note, parameter_bytes, require_accelerate
from .weights import (FileBlock, StoredBlock, StoredTensor, fill_parameters, index_checkpoint, safetensors_index,
                      stored_blocks)

NATIVE_MODEL_TYPES = native_model_types()
RANDOM_PREFIX = "random:"


def random_gpt2(preset: str, seed: int = 0, device: torch.device | str = "cpu") -> GPT2:
    """Seeded random weights, drawn on `device` (drawing 124M numbers on the CPU takes seconds; on a
    GPU, milliseconds). The same seed gives the same weights on the same kind of device."""
    if preset not in PRESETS:
        raise FastpplError(
            f"unknown model random:{preset}; use one of {', '.join(RANDOM_PREFIX + p for p in PRESETS)}"
        )
    return random_native(preset, seed, device)


def check_random_preset(spec: str) -> None:
    """An unknown random:<preset> is reported as such before the tokenizer (named after the model) is looked for."""
    if spec.startswith(RANDOM_PREFIX) and spec[len(RANDOM_PREFIX):] not in presets():
        raise FastpplError(f"unknown model {spec}; use one of {', '.join(RANDOM_PREFIX + p for p in presets())}")


def random_native(preset: str, seed: int = 0, device: torch.device | str = "cpu") -> nn.Module:
    """random:<preset> of any native architecture, with seeded weights drawn on `device`."""
    check_random_preset(RANDOM_PREFIX + preset)
    model = spec_of_preset(preset).build(preset, device)
    model.init_weights(torch.Generator(device=device).manual_seed(seed))
    return model


def native_to_hf(native: nn.Module) -> nn.Module:
    """The transformers model with the same weights as a native one (for --backend hf and for tests)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    spec = spec_of(native)
    hf_model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec.config_to_hf(native.config)))
    state = spec.state_dict_to_hf(native)
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    assert not unexpected, f"weights transformers does not know: {unexpected[:3]}"
    assert all(k.endswith((".attn.bias", ".attn.masked_bias")) for k in missing), f"not loaded: {missing[:3]}"
    return hf_model


def position_limit_note(model: nn.Module) -> str:
    """Why a native model's position limit is lower than its checkpoint's, for an error about it, or ""."""
    window = getattr(getattr(model, "config", None), "attention_window", None)
    if spec_of(model) is not None and window and model.max_positions == window:
        return (f" (the checkpoint's sliding attention window: the native model attends to whole windows, which "
                f"is the checkpoint's attention only up to {window} positions; --backend hf goes further)")
    return ""


def local_checkpoint_dir(spec: str, flag: str = "--model") -> Optional[Path]:
    """The directory --model (or flag) names, or None for a hub id; a file, or a path to nothing, is an error."""
    path = Path(spec).expanduser()
    if path.is_dir():
        check_directory_members(path, f"remove it from the checkpoint directory, or check {flag}")
        return path
    if gguf_spec(spec):   # a GGUF file (fastppl.models.gguf): a local one's header checked now, before its tokenizer
        if gguf_spec(spec)[0] is None:
            open_gguf(spec)
        return None
    if path.exists():
        raise FastpplError(f"{spec}: is a file; {flag} takes a checkpoint directory (config.json + weights)")
    if is_path_like(spec) or is_link_loop(spec):
        raise FastpplError(f"{spec}: {no_such(spec, 'model directory')}; check {flag}")
    return None


def resolve_checkpoint_dir(spec: str) -> Path:
    """A local directory as is; otherwise a hub id, downloaded (or taken from the HF cache)."""
    local = local_checkpoint_dir(spec)
    if local is not None:
        return local
    try:
        from huggingface_hub import snapshot_download

        from .hub import hub_patterns   # one weight format, the config and the tokenizer files
        return Path(snapshot_download(spec, allow_patterns=hub_patterns(spec)))
    except Exception as e:
        how = f"({first_line(e)}); offline, pass --model PATH to a checkpoint directory, or random:gpt2 for random " \
              "weights"
        if is_unreachable(e):
            raise Unreachable(f"model {spec!r}: not a local directory, and the hub is unreachable {how}") from None
        raise FastpplError(f"unknown model {spec!r}: not a local directory, and the hub did not serve it {how}") \
            from None


def _read_config(directory: Path) -> dict:
    config_path = directory / "config.json"
    if not config_path.exists():
        raise FastpplError(f"{directory}: has no config.json; pass a Hugging Face checkpoint directory")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FastpplError(f"{config_path}: is not valid JSON ({e}); the checkpoint is corrupt") from None
    if not isinstance(config, dict):
        raise FastpplError(f"{config_path}: holds a JSON {type(config).__name__}, not an object of settings; "
                           "the checkpoint is corrupt")
    return config


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:h|layers)\.(\d+)\.")


def _safetensors_shapes(directory: Path) -> dict[str, tuple]:
    """{name: shape} from the safetensors headers, no weight read; {} without safetensors or where a header is
    damaged (checkpoint_index then says so)."""
    shapes = {}
    for file in _weight_files(directory, "model.safetensors", "*.safetensors"):
        try:
            shapes.update({name: stored.shape for name, stored in safetensors_index(file).items()})
        except FastpplError:
            return {}
    return shapes


def check_config_fits_weights(directory: Path, hf_config: dict, spec: ModelSpec) -> None:
    """Before anything is built: the layers and embedding config.json describes against the weights' shapes, so
    that a config of a billion layers or of another model's vocabulary is one line, not a hang or out of memory."""
    shapes = _safetensors_shapes(directory)
    keys = spec.hf_size_keys
    layers_key, vocab_key, width_key, embedding = keys.layers, keys.vocab, keys.width, keys.embedding
    layers = [int(m.group(1)) for name in shapes if (m := _LAYER_INDEX.search(name))]
    n_layer = hf_config.get(layers_key)
    if layers and type(n_layer) is int and n_layer > max(layers) + 1:   # fewer: _refuse_dropped_weights names one
        raise FastpplError(f"{directory}/config.json: has {n_layer:,} layers but the weights hold {max(layers) + 1}; "
                           "the checkpoint is corrupt or its config.json belongs to another model")
    name = next((n for n in shapes if n.endswith(embedding)), None)
    described = (hf_config.get(vocab_key), hf_config.get(width_key))
    if name and all(type(size) is int for size in described) and shapes[name] != described:
        raise FastpplError(f"{directory}/config.json: describes an embedding of {described[0]:,} x {described[1]:,} "
                           f"but {name} is {' x '.join(f'{s:,}' for s in shapes[name])}; the checkpoint is corrupt "
                           "or its config.json belongs to another model")


def checkpoint_index(directory: Path) -> dict[str, StoredTensor]:
    """Every tensor of model.safetensors (or its shards), else of pytorch_model.bin: dtype, shape and where it
    lies, no weight read; a corrupt file is a one-line error."""
    safetensors_files = _weight_files(directory, "model.safetensors", "*.safetensors")
    bin_files = _weight_files(directory, "pytorch_model.bin", "pytorch_model*.bin")
    if not safetensors_files and not bin_files:
        raise FastpplError(f"{directory}: holds no model.safetensors or pytorch_model.bin; pass a checkpoint "
                           "directory that has its weights")
    return index_checkpoint(safetensors_files or bin_files)


def _weight_files(directory: Path, single: str, pattern: str) -> list[Path]:
    """The files transformers would read: those an index names (single + ".index.json"), else the single file,
    else every file of the pattern. Not a glob first: a repo may hold a second copy of the weights under other
    names (Mistral's consolidated.safetensors), which would double the memory."""
    index = directory / (single + ".index.json")
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise FastpplError(
                f"{index}: not a weight index (no weight_map of files); the checkpoint is corrupt") from None
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise FastpplError(f"{index}: names {missing[0]}, which is missing; download the checkpoint again")
        return [directory / n for n in names]
    if (directory / single).is_file():
        return [directory / single]
    return sorted(directory.glob(pattern))


def _load_hf(directory: Path, dtype: torch.dtype, why: str, device_map: Optional[dict] = None) -> HFCausalLM:
    from transformers import AutoModelForCausalLM

    from ..quiet import quiet_transformers
    # quiet: no progress bar or load report on stderr; problems with the weights are raised below
    try:
        with quiet_transformers():
            hf_model, loading_info = AutoModelForCausalLM.from_pretrained(
                str(directory), dtype=dtype, output_loading_info=True, device_map=device_map)
    except Exception as e:
        if "ignore_mismatched_sizes" in str(e):   # its own text points at a report that is not shown
            raise FastpplError(f"{directory}: holds weights of other shapes than its config.json implies; the "
                               "checkpoint does not match its config") from None
        raise FastpplError(
            f"{directory}: transformers cannot load it ({first_line(e)}); the checkpoint is corrupt or of an "
            "unsupported architecture"
        ) from None
    # transformers fills weights missing from the checkpoint with random values and only warns
    missing = sorted(loading_info["missing_keys"])
    if missing:
        raise FastpplError(
            f"{directory}: checkpoint lacks {len(missing)} weights (first: {missing[0]}); the file is "
            "incomplete or does not match config.json"
        )
    return HFCausalLM(hf_model, why, offloaded=device_map is not None)


def _load_offloaded(directory: Path, dtype: torch.dtype, why: str, gpu_bytes: int,
                    device: torch.device) -> HFCausalLM:
    """A transformers model bigger than the GPU, part of it in host memory (fastppl.models.hf_offload)."""
    require_accelerate()
    device_map = offload_device_map(meta_model(directory), gpu_bytes, dtype, device.index or 0)
    return _load_hf(directory, dtype, f"{why}; {offload_note(device_map)}", device_map)


class NoNativeModel(FastpplError):
    """--backend native for a checkpoint the native models do not implement; reason says why."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def load_model(spec: str, backend: str = "auto", dtype: torch.dtype = torch.float32, seed: int = 0,
               device: torch.device | str = "cpu", streamed: bool = False,
               offload_bytes: Optional[int] = None) -> nn.Module:
    """A model in eval mode with the engine's interface (hidden states + lm_head). Random weights are
    drawn on `device`, a checkpoint's read straight to it (native models; --backend hf loads on the CPU and the
    caller moves the model). streamed (the layer-major path, fastppl.runner): a native model's blocks rest in host
    memory, or, where the checkpoint stores them quantized (GGUF, compressed-tensors), on `device` in their stored
    form, as the model's `stored_blocks` (fastppl.models.weights.StoredBlock), its blocks left on the meta
    device. Random weights are drawn on `device` either way (the same seed, the same weights, on the same kind of
    device), for the caller to move their blocks to host memory. offload_bytes (a transformers checkpoint bigger
    than the GPU, fastppl.runner.choose_placement): what of it the GPU `device` may hold, the rest in host memory."""
    if streamed and not spec.startswith(RANDOM_PREFIX) and not _quantized(spec):
        device = "cpu"
    if spec.startswith(RANDOM_PREFIX):
        native = random_native(spec[len(RANDOM_PREFIX):], seed, device if backend != "hf" else "cpu")
        model: nn.Module = HFCausalLM(native_to_hf(native), "--backend hf") if backend == "hf" else native
        return model.to(dtype).eval()

    gguf = open_gguf(spec) if gguf_spec(spec) else None   # a GGUF: its metadata as config, its tensors indexed
    directory = gguf.path if gguf else resolve_checkpoint_dir(spec)
    hf_config = gguf.hf_config if gguf else _read_config(directory)
    model_type = hf_config.get("model_type")
    family = spec_for_model_type(model_type)
    if family is not None and not gguf:   # a GGUF's metadata is checked as it is read (fastppl.models.gguf)
        check_sizes_and_factors(with_nested_keys(hf_config), family.hf_sizes, family.hf_factors,
                                f"{directory}/config.json:", "the checkpoint is corrupt")
        check_config_fits_weights(directory, hf_config, family)

    def load_hf(why: str) -> nn.Module:
        if offload_bytes is not None and not gguf:
            return _load_offloaded(directory, dtype, why, offload_bytes, torch.device(device)).eval()
        return (load_hf_gguf(gguf, dtype, why) if gguf else _load_hf(directory, dtype, why)).eval()
    if backend == "hf":
        return load_hf("--backend hf")
    try:
        if family is None:
            raise NotNative(f"model_type {model_type!r} has no native implementation "
                            f"({', '.join(NATIVE_MODEL_TYPES)})")
        config = _native_config(directory, family, hf_config)
    except NotNative as e:
        reason = str(e) if family is None else f"the native {family.name} model does not implement {e}"
        if backend == "native":
            raise NoNativeModel(f"{spec}: {reason}; use --backend hf", reason) from None
        return load_hf(f"auto: {reason}" if family is None else f"auto: the native model does not implement {e}")
    index = gguf.index if gguf else None
    if is_compressed_tensors(hf_config):   # llm-compressor's weight-only schemes: dequantized as they are read
        index = compressed_index(checkpoint_index(directory), hf_config, str(directory))
    return _load_native(directory, family, config, dtype, device, index, streamed)


def _quantized(spec: str) -> bool:
    """Whether --model names a checkpoint of quantized blocks: a GGUF file or a compressed-tensors directory."""
    if gguf_spec(spec):
        return True
    path = Path(spec).expanduser()
    try:
        return path.is_dir() and is_compressed_tensors(_read_config(path))
    except FastpplError:
        return False   # loading says what is wrong


def weights_bytes(spec: str, backend: str, dtype: torch.dtype) -> Optional[int]:
    """The bytes of a native model's parameters in dtype, from its config alone (built on the meta device, nothing
    read or allocated); None for a model transformers runs (or a config the loader will refuse)."""
    if backend == "hf":
        return None
    try:
        if spec.startswith(RANDOM_PREFIX):
            preset = spec[len(RANDOM_PREFIX):]
            family = spec_of_preset(preset)
            config = family.presets[preset] if family is not None else None
        else:
            gguf = open_gguf(spec) if gguf_spec(spec) else None
            hf_config = gguf.hf_config if gguf else _read_config(resolve_checkpoint_dir(spec))
            family = spec_for_model_type(hf_config.get("model_type"))
            config = family.config_from_hf(hf_config) if family is not None else None
        if config is None:
            return None
        with torch.device("meta"), _NoInitialisation():
            model = family.model_class(config)
    except (NotNative, KeyError, TypeError, ValueError, AssertionError):
        return None   # loading the model says what is wrong with it
    return parameter_bytes(model, dtype)


def _native_config(directory: Path, family: ModelSpec, hf_config: dict):
    """The family's native config of config.json; NotNative passes through (the caller falls back or refuses)."""
    try:
        return family.config_from_hf(hf_config)
    except NotNative:
        raise
    except KeyError as e:
        raise FastpplError(f"{directory}/config.json: lacks {e}; the checkpoint is corrupt") from None
    except (TypeError, ValueError, AssertionError) as e:   # a wrong type, a negative size, ...
        raise FastpplError(f"{directory}/config.json: does not describe a valid model ({first_line(e, 160)}); "
                           "the checkpoint is corrupt") from None


class _NoInitialisation(TorchFunctionMode):
    """Initialisers of meta tensors return at once: they compute nothing there, and torch builds the meta kernel
    of normal_ at its first call, which took seconds (the tensors are all read from the checkpoint anyway)."""
    INITIALISERS = {"normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                    "xavier_normal_", "zeros_", "ones_", "zero_", "fill_", "constant_"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        target = args[0] if args else (kwargs or {}).get("tensor")   # torch.nn.init passes it by name
        if getattr(func, "__name__", None) in self.INITIALISERS and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **(kwargs or {}))


def _load_native(directory: Path, family: ModelSpec, config, dtype: torch.dtype, device: torch.device | str,
                 index: Optional[dict[str, StoredTensor]] = None, streamed: bool = False) -> nn.Module:
    """Build on the meta device (no memory, no init), allocate on `device` in `dtype`, then read every weight
    into place, a tensor at a time (fastppl.models.weights). streamed with a quantized index: the blocks stay
    on the meta device and their stored tensors go to `device` as they are (load_model)."""
    try:
        with torch.device("meta"), _NoInitialisation():
            model = family.model_class(config)
    except (TypeError, ValueError, AssertionError, RuntimeError) as e:   # a wrong type, a negative size, ...
        raise FastpplError(f"{directory}/config.json: does not describe a valid model ({first_line(e, 160)}); "
                           "the checkpoint is corrupt") from None
    # all checked before allocating
    pieces = family.checkpoint_pieces(model, index or checkpoint_index(directory), str(directory))
    quantized = any(stored.decode is not None for stored, _ in pieces)
    if streamed and (quantized or host_memory_short_of(model.blocks, dtype)):
        model.stored_blocks, pieces = stored_blocks(pieces, len(model.blocks), torch.device(device),
                                                    StoredBlock if quantized else FileBlock)
        blocks, model.blocks = model.blocks, nn.ModuleList()   # the rest of the model allocated and filled
        _allocate_parameters(model, dtype, device)
        fill_parameters(model, pieces)
        model.blocks = blocks
        return model.eval()
    _allocate_parameters(model, dtype, device)
    fill_parameters(model, pieces)
    return model.eval()


# the blocks rest in host memory where they take at most this share of what is available
HOST_SHARE = 0.9


def available_host_memory() -> Optional[int]:
    """The host memory available to a new allocation: MemAvailable of /proc/meminfo, or less where this process'
    control group (a container's limit) leaves less; None where unknown."""
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    try:   # cgroup v2: memory.max ("max" where unlimited) less what the group uses
        group = Path("/sys/fs/cgroup")
        limit = (group / "memory.max").read_text().strip()
        if limit != "max" and available is not None:
            available = min(available, int(limit) - int((group / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return available


def host_memory_short_of(blocks: nn.Module, dtype: torch.dtype) -> bool:
    """Whether the (meta) blocks in dtype take more than HOST_SHARE of the available host memory (said in one
    warning: they are then read from the checkpoint's files, more slowly)."""
    available = available_host_memory()
    # each process of this machine (torchrun's LOCAL_WORLD_SIZE) holds its own copy of the blocks
    copies = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    needed = parameter_bytes(blocks, dtype) * copies
    if available is None or needed <= HOST_SHARE * available:
        return False
    print(f"fastppl: warning: the blocks take {needed / 2**30:.2f} GiB, more than {HOST_SHARE:.0%} of the host "
          f"memory available ({available / 2**30:.2f} GiB): they stay in the checkpoint's files and are read a "
          "block at a time, more slowly than from memory", file=sys.stderr)
    return True


def _allocate_parameters(model: nn.Module, dtype: torch.dtype, device: torch.device | str) -> None:
    """Each meta parameter replaced by an uninitialised one on `device` in `dtype`; one shared by two modules (a
    tied lm_head) stays shared. Not Module.to_empty: its empty_like from meta imported modules for a second."""
    assert not list(model.buffers()), "the native models keep no buffers"
    allocated: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, meta in list(module.named_parameters(recurse=False)):
            if id(meta) not in allocated:
                allocated[id(meta)] = nn.Parameter(torch.empty(meta.shape, dtype=dtype, device=device),
                                                   requires_grad=meta.requires_grad)
            setattr(module, name, allocated[id(meta)])


def save_hf_checkpoint(model: nn.Module, directory: os.PathLike, dtype: torch.dtype = torch.float32) -> None:
    """Write a native model as an HF checkpoint directory (config.json + model.safetensors) in dtype."""
    from safetensors.torch import save_file
    spec = spec_of(model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = spec.state_dict_to_hf(model)
    if getattr(model.config, "tie_word_embeddings", True):
        del state["lm_head.weight"]  # tied: safetensors refuses shared storage
    save_file({k: v.to("cpu", dtype).contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(spec.config_to_hf(model.config), indent=2))


def save_hf_gpt2(model: GPT2, directory: os.PathLike) -> None:
    """Write native GPT-2 weights as an HF checkpoint directory in fp32."""
    save_hf_checkpoint(model, directory)
