"""GGUF files (llama.cpp's format) read as a Hugging Face checkpoint: the metadata becomes a config.json-style dict,
the tensors an index under transformers' names, each dequantized on the run's device when it is read
(fastppl.models.gguf_quants), so that the family's ordinary checkpoint conversion (its ModelSpec) builds the native
model.

--model takes a local FILE.gguf or owner/repo:FILE.gguf (one file of a hub repository, downloaded once)."""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..config import gguf_local_path
from ..errors import FastpplError, first_line
from .gguf_file import GGUFTensorInfo, read_header
from .gguf_quants import dequantize, stored_bytes, supported_type
from .settings import check_sizes_and_factors
from .weights import StoredTensor

# GGUF general.architecture -> transformers model_type, for the families fastppl runs natively
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2"}

# GGUF tensor name -> transformers name ({} is the layer index), by family
_LLAMA_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.attn_q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "blk.{}.attn_k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
    **{f"blk.{{}}.attn_{g}.{kind}": f"model.layers.{{}}.self_attn.{h}_proj.{kind}"
       for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")) for kind in ("weight", "bias")},
    **{f"blk.{{}}.ffn_{p}.{kind}": f"model.layers.{{}}.mlp.{p}_proj.{kind}"
       for p in ("gate", "up", "down") for kind in ("weight", "bias")},
}
_GPT2_NAMES = {
    "token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
    "output_norm.weight": "transformer.ln_f.weight", "output_norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",
    **{f"blk.{{}}.{g}.{kind}": f"transformer.h.{{}}.{h}.{kind}" for kind in ("weight", "bias") for g, h in (
        ("attn_norm", "ln_1"), ("attn_qkv", "attn.c_attn"), ("attn_output", "attn.c_proj"), ("ffn_norm", "ln_2"),
        ("ffn_up", "mlp.c_fc"), ("ffn_down", "mlp.c_proj"))},
}
# tensors llama.cpp writes that are no weight of the transformers model (llama 3's RoPE factors: _llama3_rope)
_NOT_WEIGHTS = ("rope_freqs.weight",)
_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass
class GGUFCheckpoint:
    path: Path
    architecture: str               # general.architecture
    hf_config: dict                 # as a config.json would hold it
    index: dict[str, StoredTensor]  # transformers names -> tensors dequantized when read


def open_gguf(spec: str) -> GGUFCheckpoint:
    """A GGUF file's config and tensor index, checked (architecture, tensor types and extents); no weight read."""
    path = gguf_local_path(spec)
    meta, infos = read_header(path)
    architecture = meta.get("general.architecture")
    if architecture not in ARCHITECTURES:
        raise FastpplError(f"{path}: GGUF architecture {architecture!r} is not one fastppl runs "
                           f"({', '.join(ARCHITECTURES)}); run the model's Hugging Face checkpoint with --backend hf")
    tensors = _tensors(path, infos, meta.get("general.alignment", 32))
    check_metadata(meta, architecture, tensors, path)
    hf_config = (_gpt2_config if architecture == "gpt2" else _llama_config)(meta, architecture, tensors, path)
    return GGUFCheckpoint(path, architecture, hf_config, _index(path, architecture, tensors, hf_config))


def _tensors(path: Path, infos: list[GGUFTensorInfo], alignment: int) -> dict[str, tuple]:
    """{name: (info, type name, bytes)}, each tensor's data checked to lie where the table says, as llama.cpp checks
    it: one after the other in the table's order, each at the next multiple of the alignment, within the file. A
    type or shape that lies about the size of the data is so caught where the next tensor begins."""
    size, tensors, expected = path.stat().st_size, {}, 0
    for info in infos:
        type_name = supported_type(info.type_id, info.name, str(path))
        try:
            n_bytes = stored_bytes(type_name, info.shape)
        except ValueError as e:
            raise FastpplError(f"{path}: tensor {info.name}: {e}; the file is corrupt") from None
        if info.data_offset != expected:
            raise FastpplError(f"{path}: the data of tensor {info.name} starts at byte {info.data_offset:,} of the "
                               f"data section, not at {expected:,}, where the tensors before it end; the file is "
                               "corrupt")
        if info.offset + n_bytes > size:
            raise FastpplError(f"{path}: the data of tensor {info.name} runs past the end of the file; the file is "
                               "truncated, download it again")
        tensors[info.name] = (info, type_name, n_bytes)
        expected += -(-n_bytes // alignment) * alignment
    return tensors


# the metadata sizes and factors a model is built from: a size of 0 (a division by it) or of a billion blocks
# (looped over) is refused before any model is built
_SIZES = ("block_count", "embedding_length", "feed_forward_length", "context_length", "attention.head_count",
          "attention.head_count_kv", "attention.key_length", "rope.dimension_count")
_FACTORS = ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "rope.freq_base", "rope.scaling.factor")


def check_metadata(meta: dict, architecture: str, tensors: dict, path: Path) -> None:
    """Each size a positive integer, each factor a positive finite number, and block_count the blocks whose tensors
    the file holds."""
    check_sizes_and_factors(meta, [f"{architecture}.{name}" for name in _SIZES],
                            [f"{architecture}.{name}" for name in _FACTORS], f"{path}: GGUF metadata",
                            "the file is corrupt")
    blocks = 1 + max((int(m.group(1)) for name in tensors if (m := _BLOCK.match(name))), default=-1)
    count = meta.get(f"{architecture}.block_count")
    if count is not None and count != blocks:
        raise FastpplError(f"{path}: GGUF metadata {architecture}.block_count is {count:,}, but the file holds the "
                           f"tensors of {blocks} blocks; the file is corrupt or its metadata is another model's")


def _need(meta: dict, key: str, path: Path):
    if key not in meta:
        raise FastpplError(f"{path}: GGUF metadata lacks {key}; the file is incomplete")
    return meta[key]


def _embedding_rows(tensors: dict, path: Path) -> int:
    if "token_embd.weight" not in tensors:
        raise FastpplError(f"{path}: holds no token_embd.weight; the file is incomplete")
    return int(tensors["token_embd.weight"][0].shape[0])


def _llama_config(meta: dict, architecture: str, tensors: dict, path: Path) -> dict:
    def key(name):
        return f"{architecture}.{name}"
    hidden, heads = int(_need(meta, key("embedding_length"), path)), int(_need(meta, key("attention.head_count"), path))
    config = dict(
        model_type=ARCHITECTURES[architecture], vocab_size=_embedding_rows(tensors, path), hidden_size=hidden,
        intermediate_size=int(_need(meta, key("feed_forward_length"), path)),
        num_hidden_layers=int(_need(meta, key("block_count"), path)), num_attention_heads=heads,
        num_key_value_heads=int(meta.get(key("attention.head_count_kv"), heads)),
        head_dim=int(meta.get(key("attention.key_length"), meta.get(key("rope.dimension_count"), hidden // heads))),
        rms_norm_eps=float(meta.get(key("attention.layer_norm_rms_epsilon"), 1e-6)),
        rope_theta=float(meta.get(key("rope.freq_base"), 10000.0)),
        max_position_embeddings=int(meta.get(key("context_length"), 2048)), hidden_act="silu",
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors, mlp_bias="blk.0.ffn_up.bias" in tensors,
    )
    scaling = meta.get(key("rope.scaling.type"))
    if scaling not in (None, "none"):
        config["rope_scaling"] = dict(rope_type=scaling, factor=float(meta.get(key("rope.scaling.factor"), 1.0)))
        if key("rope.scaling.original_context_length") in meta:
            config["rope_scaling"]["original_max_position_embeddings"] = int(
                meta[key("rope.scaling.original_context_length")])
    if "rope_freqs.weight" in tensors:
        config["rope_scaling"] = _llama3_rope(_read_whole(path, *tensors["rope_freqs.weight"]), config, path)
    return config


def _read_whole(path: Path, info: GGUFTensorInfo, type_name: str, n_bytes: int) -> torch.Tensor:
    with open(path, "rb") as handle:
        handle.seek(info.offset)
        raw = torch.frombuffer(bytearray(handle.read(n_bytes)), dtype=torch.uint8)
    return dequantize(raw, type_name, info.shape)


def _llama3_rope(divisors: torch.Tensor, config: dict, path: Path) -> dict:
    """Llama 3.1+ GGUFs store the RoPE scaling as per-frequency divisors, not as its parameters: the parameters of
    every Llama 3 release (low 1, high 4, original context 8192, factor the largest divisor) when they reproduce
    the divisors (by transformers' llama3 formula), else an error."""
    rope = dict(rope_type="llama3", factor=float(divisors.max()), low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)
    head_dim = config["head_dim"]
    base = 1.0 / config["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelength = 2 * torch.pi / base
    low, high = 8192 / rope["low_freq_factor"], 8192 / rope["high_freq_factor"]
    smooth = (8192 / wavelength - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
    expected = torch.where(wavelength < high, 1.0, torch.where(wavelength > low, rope["factor"],
                                                               1 / ((1 - smooth) / rope["factor"] + smooth)))
    if divisors.shape != expected.shape or not torch.allclose(divisors.double(), expected, rtol=1e-5):
        raise FastpplError(f"{path}: holds RoPE frequency factors (rope_freqs) of no Llama 3 scaling fastppl knows; "
                           "run the model's Hugging Face checkpoint")
    return rope


def _gpt2_config(meta: dict, architecture: str, tensors: dict, path: Path) -> dict:
    hidden = int(_need(meta, "gpt2.embedding_length", path))
    return dict(
        model_type="gpt2", vocab_size=_embedding_rows(tensors, path), n_embd=hidden,
        n_layer=int(_need(meta, "gpt2.block_count", path)), n_head=int(_need(meta, "gpt2.attention.head_count", path)),
        n_positions=int(meta.get("gpt2.context_length", 1024)), n_ctx=int(meta.get("gpt2.context_length", 1024)),
        n_inner=int(meta.get("gpt2.feed_forward_length", 4 * hidden)),
        layer_norm_epsilon=float(meta.get("gpt2.attention.layer_norm_epsilon", 1e-5)),
        activation_function="gelu_new", tie_word_embeddings=True,
    )


def _hf_name(gguf_name: str, names: dict) -> Optional[str]:
    match = _BLOCK.match(gguf_name)
    pattern = _BLOCK.sub("blk.{}.", gguf_name) if match else gguf_name
    if pattern not in names:
        return None
    return names[pattern].format(match.group(1)) if match else names[pattern]


def _index(path: Path, architecture: str, tensors: dict, hf_config: dict) -> dict[str, StoredTensor]:
    names = _GPT2_NAMES if architecture == "gpt2" else _LLAMA_NAMES
    index = {}
    for gguf_name, (info, type_name, n_bytes) in tensors.items():
        hf_name = _hf_name(gguf_name, names)
        if hf_name is None:
            if gguf_name in _NOT_WEIGHTS:
                continue
            raise FastpplError(f"{path}: holds tensor {gguf_name}, which a {architecture} model does not have; "
                               "the file is not a plain model of its architecture")
        shape = info.shape
        transform = _transform(architecture, gguf_name, hf_config)
        if architecture == "gpt2" and transform is _conv1d:
            shape = shape[::-1]
        index[hf_name] = StoredTensor(torch.float32, shape, path, info.offset, stored_bytes=n_bytes,
                                      decode=functools.partial(_decode, type_name, info.shape, transform))
    return index


def _decode(type_name: str, stored_shape: tuple, transform, raw: torch.Tensor) -> torch.Tensor:
    values = dequantize(raw, type_name, stored_shape)
    return transform(values) if transform is not None else values


def _conv1d(values: torch.Tensor) -> torch.Tensor:
    """GPT-2's transformers checkpoints hold these matrices as (in, out); GGUF as (out, in)."""
    return values.t()


def _transform(architecture: str, gguf_name: str, hf_config: dict):
    """What undoes llama.cpp's conversion of this tensor, or None."""
    if architecture == "gpt2" and gguf_name.endswith(("attn_qkv.weight", "attn_output.weight", "ffn_up.weight",
                                                        "ffn_down.weight")):
        return _conv1d
    # llama.cpp permutes the rows of Llama's q and k to its RoPE layout; transformers undoes it for "llama" only
    if architecture == "llama" and re.search(r"\.attn_[qk]\.", gguf_name):
        heads = hf_config["num_attention_heads"] if ".attn_q." in gguf_name else hf_config["num_key_value_heads"]
        return functools.partial(unpermute_rope_rows, n_head=heads)
    return None


def unpermute_rope_rows(values: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute for q and k (transformers' LlamaTensorProcessor._reverse_permute_weights):
    within each head, rows (pair, 2) -> (2, pair)."""
    rows = values.shape[0]
    return values.reshape(n_head, rows // n_head // 2, 2, *values.shape[1:]).transpose(1, 2).reshape(values.shape)


def load_hf_gguf(checkpoint: GGUFCheckpoint, dtype: torch.dtype, why: str):
    """The GGUF as transformers loads it (--backend hf, or an architecture the native models lack). A file with a
    RoPE scaling is refused: transformers' GGUF config reads no scaling key, so it would score another model."""
    from transformers import AutoModelForCausalLM

    from ..quiet import quiet_transformers
    from .hf_backend import HFCausalLM
    scaling = checkpoint.hf_config.get("rope_scaling")
    if scaling:
        raise FastpplError(f"{checkpoint.path}: its RoPE scaling ({scaling.get('rope_type')}) would be dropped by "
                           f"transformers' GGUF loader ({why}); run it with --backend native where the native model "
                           "implements that scaling, or score the original Hugging Face checkpoint")
    hide_bar = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"   # transformers' GGUF loader draws its own progress bar
    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(str(checkpoint.path.parent), gguf_file=str(checkpoint.path),
                                                         dtype=dtype)
    except Exception as e:
        raise FastpplError(f"{checkpoint.path}: transformers cannot load this GGUF ({first_line(e)}); "
                           "use --backend native") from None
    finally:
        if hide_bar is None:
            os.environ.pop("TQDM_DISABLE")
        else:
            os.environ["TQDM_DISABLE"] = hide_bar
    return HFCausalLM(model, why)
