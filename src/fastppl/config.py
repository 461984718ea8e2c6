"""Configuration dataclasses; the CLI is a thin mapping onto these."""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from .errors import FastpplError

WINDOW_MODES = ("chunked", "sliding")
DTYPES = ("auto", "fp32", "bf16", "fp16")
BACKENDS = ("auto", "native", "hf")
BATCHING_SETTINGS = ("auto", "packed", "bucketed", "padded")
MIN_BOOTSTRAP = 100
# --protocol NAME and the windows it fixes (fastppl.data.protocols holds the rest of each)
PROTOCOL_WINDOWS = {"lm-eval-rolling": "chunked", "hf-guide": "sliding", "gptq": "blocks", "llama.cpp": "blocks",
                    "lm-eval-wikitext": "chunked"}


def is_path_like(spec: str) -> bool:
    """A --model or --tokenizer that names a path, not a hub id ("name" or "org/name"): it starts like one, or
    has more than one "/"."""
    return spec.startswith((".", "/", "~")) or spec.count("/") > 1


_HUB_GGUF = re.compile(r"^([\w.-]+/[\w.-]+):([^:]+\.gguf)$")


def gguf_spec(spec: str) -> Optional[tuple[Optional[str], str]]:
    """(None, path) for a --model or --tokenizer that names a local .gguf file, (repo, file) for owner/repo:FILE.gguf
    on the hub, else None."""
    if not spec.lower().endswith(".gguf"):
        return None
    hub = _HUB_GGUF.match(spec)
    return (hub.group(1), hub.group(2)) if hub and not Path(spec).expanduser().exists() else (None, spec)


def cache_dir() -> Path:
    """Where downloads, token ids and compiled artefacts are kept (FASTPPL_CACHE_DIR overrides)."""
    root = os.environ.get("FASTPPL_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "fastppl" if xdg else Path.home() / ".cache" / "fastppl"


@dataclass
class EvalConfig:
    model: str                          # HF directory, hub id, or random:<preset>
    data: list[str]                     # paths or built-in corpus names
    tokenizer: Optional[str] = None     # defaults to the model's own tokenizer
    split: str = "all"                  # train | val | all (nanoGPT's 90/10 split by characters)
    text_field: str = "text"            # the field of a .jsonl line that holds the document
    id_field: Optional[str] = None      # .jsonl / hf: the field of the document's id (default: "id" if present)
    group_by: Optional[str] = None      # .jsonl / hf: the field whose values group the documents' results
    data_dir: Optional[str] = None      # local copies of built-in corpora (or FASTPPL_DATA_DIR)
    errors: str = "strict"              # undecodable bytes: strict (error) or replace
    window: str = "chunked"             # chunked | sliding, see fastppl.data.windows (blocks: set by a protocol)
    protocol: Optional[str] = None      # a named protocol, see fastppl.data.protocols; it sets window
    ctx: Optional[int] = None           # tokens per window; None = the model's maximum
    stride: Optional[int] = None        # sliding only; None = ctx // 2
    bos: bool = False                   # sliding only: prefix BOS so that the first token is scored
    batch_size: int | str = "auto"      # rows per batch; auto = largest that fits (CUDA), 8 on the CPU
    device: str = "auto"                # auto | cpu | cuda | cuda:N
    dtype: str = "auto"                 # auto = bf16 on CUDA, fp32 on CPU
    backend: str = "auto"               # auto = native when the architecture has one, else hf
    compile: str = "auto"               # auto | on | off
    tune_products: str = "off"          # on | off: cuBLASLt's fastest candidate per product, see accel.cublaslt
    loss: str = "auto"                  # auto | chunked | fused (Triton, CUDA)
    loss_chunk_rows: int = 8192         # chunked: rows of the output projection computed at once
    kv_cache: str = "auto"              # sliding windows on rotary models: reuse keys/values (on) or not; auto = off
    seed: int = 0                       # seeds random:<preset> weights
    per_token: Optional[str] = None     # .npy of per-token NLL
    quiet: bool = False
    batching: str = "auto"              # auto | packed | bucketed | padded, see fastppl.data.packing
    per_doc: Optional[str] = None       # JSON lines, one per scored document: id, tokens, bytes, words, nll_sum
    bootstrap: int = 0                  # resamples of the bootstrap interval (0: none), see fastppl.report.stats
    bootstrap_seed: int = 0             # the bootstrap's resampling seed: the same seed, the same interval
    resume: Optional[str] = None        # checkpoint directory of a resumable run, see fastppl.resume
    checkpoint_seconds: float = 60.0    # with resume: save at least this often ...
    checkpoint_batches: Optional[int] = None   # ... and every this many batches
    reference_model: Optional[str] = None   # divergence of --model from this one, see fastppl.reference
    reference_seed: Optional[int] = None    # seeds a random:<preset> reference; None = seed
    reference_device: Optional[str] = None  # where the reference runs; None = device

    def __post_init__(self) -> None:
        if self.protocol is not None:
            self._apply_protocol()
        if self.window not in WINDOW_MODES and not (self.protocol and self.window == "blocks"):
            raise FastpplError(f"unknown --window {self.window!r}; use one of {', '.join(WINDOW_MODES)}")
        if self.dtype not in DTYPES:
            raise FastpplError(f"unknown --dtype {self.dtype!r}; use one of {', '.join(DTYPES)}")
        if self.backend not in BACKENDS:
            raise FastpplError(f"unknown --backend {self.backend!r}; use one of {', '.join(BACKENDS)}")
        if self.split not in ("train", "val", "all"):
            raise FastpplError(f"unknown --split {self.split!r}; use train, val or all")
        if self.errors not in ("strict", "replace"):
            raise FastpplError(f"unknown --errors {self.errors!r}; use strict or replace")
        if self.compile not in ("auto", "on", "off"):
            raise FastpplError(f"unknown --compile {self.compile!r}; use auto, on or off")
        if self.tune_products not in ("on", "off"):
            raise FastpplError(f"unknown --tune-products {self.tune_products!r}; use on or off")
        if self.kv_cache not in ("auto", "on", "off"):
            raise FastpplError(f"unknown --kv-cache {self.kv_cache!r}; use auto, on or off")
        if self.batch_size != "auto" and (not isinstance(self.batch_size, int) or self.batch_size < 1):
            raise FastpplError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.ctx is not None and self.ctx < 2:
            raise FastpplError(f"--ctx must be at least 2, got {self.ctx}")
        if self.stride is not None and self.window != "sliding":
            raise FastpplError("--stride applies to --window sliding only")
        if self.kv_cache == "on" and self.window != "sliding":
            raise FastpplError("--kv-cache on applies to --window sliding only (chunked windows share no tokens)")
        if self.bos and self.window != "sliding":
            raise FastpplError("--bos applies to --window sliding only (chunked windows always start with BOS)")
        if self.loss not in ("auto", "chunked", "fused"):
            raise FastpplError(f"unknown --loss {self.loss!r}; use auto, chunked or fused")
        if self.batching not in BATCHING_SETTINGS:
            raise FastpplError(f"unknown --batching {self.batching!r}; use one of {', '.join(BATCHING_SETTINGS)}")
        if self.checkpoint_batches is not None and self.checkpoint_batches < 1:
            raise FastpplError(f"--checkpoint-batches must be at least 1, got {self.checkpoint_batches}")
        if not (self.checkpoint_seconds >= 0):   # also refuses NaN, which would never trigger a checkpoint
            raise FastpplError(f"--checkpoint-seconds must be a number >= 0, got {self.checkpoint_seconds}")
        if self.bootstrap != 0 and not (isinstance(self.bootstrap, int) and self.bootstrap >= MIN_BOOTSTRAP):
            # fewer resamples put the 2.5 % and 97.5 % percentiles on a handful of values
            raise FastpplError(f"--bootstrap must be 0 (off) or at least {MIN_BOOTSTRAP}, got {self.bootstrap}")
        if self.bootstrap_seed < 0:
            raise FastpplError(f"--bootstrap-seed must be at least 0, got {self.bootstrap_seed}")
        if self.loss_chunk_rows < 1:
            raise FastpplError("--loss-chunk-rows must be at least 1")

    def _apply_protocol(self) -> None:
        """A protocol fixes the windows and the BOS rule: options that would change them are refused."""
        if self.protocol not in PROTOCOL_WINDOWS:
            raise FastpplError(f"unknown --protocol {self.protocol!r}; use one of {', '.join(PROTOCOL_WINDOWS)}")
        window = PROTOCOL_WINDOWS[self.protocol]
        if self.window not in ("chunked", window):   # chunked: the default, left as it is
            raise FastpplError(f"--window {self.window} does not go with --protocol {self.protocol}, which fixes its "
                               "windows; drop --window")
        self.window = window
        fixed = [flag for flag, given in (("--bos", self.bos), ("--kv-cache on", self.kv_cache == "on"),
                                          ("--stride", self.stride is not None and window != "sliding")) if given]
        if fixed:
            raise FastpplError(f"{fixed[0]} does not go with --protocol {self.protocol}, which fixes what it would "
                               f"change; drop {fixed[0]}")

    def to_dict(self) -> dict:
        return asdict(self)
