"""Configuration dataclasses; the CLI is a thin mapping onto these."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
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
PLACEMENTS = ("auto", "resident", "streamed")
MIN_BOOTSTRAP = 100
# more resamples move the interval's ends by less than their own sampling error, and hold more memory
MAX_BOOTSTRAP = 1_000_000
DEFAULT_CHECKPOINT_SECONDS = 60.0
# --protocol NAME and the windows it fixes (fastppl.data.protocols holds the rest of each)
PROTOCOL_WINDOWS = {"lm-eval-rolling": "chunked", "hf-guide": "sliding", "gptq": "blocks", "llama.cpp": "blocks",
                    "lm-eval-wikitext": "chunked"}
PROTOCOL_TEXT_FIELDS = {"lm-eval-wikitext": "page"}   # the default --text-field where it is not "text"
PROTOCOL_MIN_CTX = {"llama.cpp": 3}                   # it scores positions ctx/2 .. ctx-2 only
# --data NAME of a corpus as the quantization literature reads it, and the protocols that read it
# (fastppl.data.protocols.CORPORA holds where and how)
CORPUS_PROTOCOLS = {"wikitext2": ("gptq", "hf-guide"), "c4": ("gptq",)}


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


def gguf_local_path(spec: str, flag: str = "--model") -> Path:
    """The local file a GGUF spec names (gguf_spec): the file itself, or owner/repo:FILE.gguf downloaded once into
    the Hugging Face cache; `flag` is the option the error names."""
    from .errors import check_input_file, first_line
    repo, filename = gguf_spec(spec)
    if repo is None:
        check_input_file(filename, f"check {flag}")
        return Path(filename).expanduser()
    try:
        from huggingface_hub import hf_hub_download
        return Path(hf_hub_download(repo, filename))
    except Exception as e:
        from .errors import Unreachable, is_unreachable
        if is_unreachable(e):
            raise Unreachable(f"{spec}: the hub is unreachable ({first_line(e)}); pass {flag} PATH to a local "
                              ".gguf file") from None
        raise FastpplError(f"{spec}: the hub did not serve {filename} of {repo} ({first_line(e)}); check the "
                           f"repository and file name, or pass {flag} PATH to a local .gguf file") from None


LOCAL_GPT2_TOKENIZER = "gpt2-tokenizer"   # the GPT-2 tokenizer's folder in a data directory


def data_directories(data_dir: Optional[str]) -> list[str]:
    """--data-dir, then FASTPPL_DATA_DIR: where built-in corpora (and a GPT-2 tokenizer) are looked for."""
    return [d for d in (data_dir, os.environ.get("FASTPPL_DATA_DIR")) if d]


def local_gpt2_tokenizer(data_dir: Optional[str]) -> Optional[str]:
    """A data directory's gpt2-tokenizer folder, if one has it (random: presets' tokenizer without the hub)."""
    for directory in data_directories(data_dir):
        path = Path(directory) / LOCAL_GPT2_TOKENIZER
        if (path / "tokenizer.json").is_file() or (path / "vocab.json").is_file():
            return str(path)
    return None


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
    text_field: Optional[str] = None    # the field of a .jsonl line that holds the document; None = "text", or
                                        # the protocol's own (PROTOCOL_TEXT_FIELDS)
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
    checkpoint_seconds: Optional[float] = None   # with resume: save at least this often (None: 60) ...
    checkpoint_batches: Optional[int] = None   # ... and every this many batches
    reference_model: Optional[str] = None   # divergence of --model from this one, see fastppl.reference
    reference_seed: Optional[int] = None    # seeds a random:<preset> reference; None = seed
    reference_device: Optional[str] = None  # where the reference runs; None = device
    placement: str = "auto"             # resident | streamed (blocks from host memory, fastppl.runner) | auto
    max_gpu_memory: Optional[int | str] = None   # bytes (or "8GiB") the run may hold on the device; None = all
    layer_error: bool = False           # compare the model with the reference block by block (engine.layer_error)

    def __post_init__(self) -> None:
        """Every option and combination of options is checked here, before anything is read or built (what only
        the model or the corpus can tell is checked where that becomes known: check_ctx with the model's maximum
        context); then the defaults that depend on other options are resolved."""
        try:
            if isinstance(self.max_gpu_memory, str):
                self.max_gpu_memory = memory_size(self.max_gpu_memory, "--max-gpu-memory")
            check_options(self)
            check_ctx(self, self.ctx)
        except FastpplError as e:
            raise in_python_spelling(e) from None
        if self.protocol is not None:
            self.window = PROTOCOL_WINDOWS[self.protocol]
        if self.text_field is None:
            self.text_field = PROTOCOL_TEXT_FIELDS.get(self.protocol, "text")
        if self.checkpoint_seconds is None:
            self.checkpoint_seconds = DEFAULT_CHECKPOINT_SECONDS

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------------------- the options' checks
# option, EvalConfig field, its values (argparse offers the same choices; these check the Python API's configs)
CHOICES = (("--window", "window", WINDOW_MODES), ("--dtype", "dtype", DTYPES), ("--backend", "backend", BACKENDS),
           ("--split", "split", ("train", "val", "all")), ("--errors", "errors", ("strict", "replace")),
           ("--compile", "compile", ("auto", "on", "off")), ("--tune-products", "tune_products", ("on", "off")),
           ("--kv-cache", "kv_cache", ("auto", "on", "off")), ("--loss", "loss", ("auto", "chunked", "fused")),
           ("--batching", "batching", BATCHING_SETTINGS), ("--placement", "placement", PLACEMENTS))


# ------------------------------------------------------------------- an option's name in an error message
# set while the CLI runs: its messages name options as the CLI spells them (--per-doc); the Python API's name the
# EvalConfig field (per_doc)
_CLI_RUNNING = contextvars.ContextVar("fastppl_cli_running", default=False)
_OPTION = re.compile(r"--([a-z][a-z0-9-]*)( [A-Za-z0-9][\w.:/-]*)?")


@contextlib.contextmanager
def cli_spelling():
    """Within: in_python_spelling leaves errors as they are (the CLI prints them)."""
    token = _CLI_RUNNING.set(True)
    try:
        yield
    finally:
        _CLI_RUNNING.reset(token)


def _field_values() -> dict[str, tuple]:
    return {**{name: values for _, name, values in CHOICES}, "protocol": tuple(PROTOCOL_WINDOWS),
            "batch_size": ("auto",)}


def python_spelling(message: str) -> str:
    """message with each option that is an EvalConfig field named as the field (--per-doc: per_doc), and a value
    after it as the field's value (--kv-cache on: kv_cache="on", --ctx 64: ctx=64, --resume DIR: resume=DIR); the
    CLI's other options (--nproc, --json) stay as they are."""
    fields, values = {f.name for f in dataclasses.fields(EvalConfig)}, _field_values()

    def field(match: re.Match) -> str:
        name, after = match.group(1).replace("-", "_"), match.group(2) or ""
        if name not in fields:
            return match.group(0)
        word = after.strip()
        if word in values.get(name, ()):
            return f'{name}="{word}"'
        if word.isdigit() or (word.isupper() and word.isalpha()):   # a number, or a placeholder (DIR, PATH)
            return f"{name}={word}"
        return name + after
    return _OPTION.sub(field, message)


def in_python_spelling(error: FastpplError) -> FastpplError:
    """error (its class and attributes kept) with its message in python_spelling, unless the CLI runs."""
    if not _CLI_RUNNING.get() and error.args and isinstance(error.args[0], str):
        error.args = (python_spelling(error.args[0]), *error.args[1:])
    return error


def check_options(config: EvalConfig) -> None:
    """Every option of an eval and every combination of them: one line naming the option and the fix."""
    _check_choices(config)
    _check_numbers(config)
    _check_names(config)
    if config.protocol is not None:
        _check_protocol(config)
    _check_windows(config)
    _check_fields(config)
    _check_named_corpora(config)
    _check_resume(config)
    _check_reference(config)
    _check_placement(config)
    _check_layer_error(config)


def check_ctx(config: EvalConfig, ctx: Optional[int]) -> None:
    """The options that depend on the context: at construction with --ctx, or with the model's maximum when the
    model is known (ctx None: only what holds for every context)."""
    stride = config.stride
    if stride is not None and (stride < 1 or (ctx is not None and stride > ctx)):
        bounds = f"between 1 and --ctx ({ctx})" if ctx is not None else "at least 1"
        raise FastpplError(f"--stride must be {bounds}, got {stride}")
    minimum = PROTOCOL_MIN_CTX.get(config.protocol)
    if minimum is not None and ctx is not None and ctx < minimum:
        raise FastpplError(f"--protocol {config.protocol} scores positions from ctx/2 to ctx-2, none with --ctx "
                           f"{ctx}; use --ctx {minimum} or more")


def check_one_process(config: EvalConfig) -> None:
    """Options that run in one process only, refused under --nproc or torchrun before anything starts."""
    for flag, given in (("--resume", config.resume is not None), ("--kv-cache on", config.kv_cache == "on"),
                        ("--reference-device", config.reference_device is not None),
                        ("--layer-error", config.layer_error)):
        if given:
            raise FastpplError(f"{flag} runs in one process only; drop it or run without --nproc / torchrun")


def check_model_spec(spec: Optional[str], flag: str) -> None:
    """--model, --reference-model or --tokenizer given as an empty string: else it would read as not given, or
    fail obscurely as a path."""
    if spec is None or spec.strip():
        return
    if flag == "--tokenizer":
        raise FastpplError("--tokenizer is empty; give a tokenizer directory or hub id, or leave it out")
    raise FastpplError(f"{flag} is empty; give a checkpoint directory, a hub id or random:<preset>")


def _check_choices(config: EvalConfig) -> None:
    for flag, name, values in CHOICES:
        value = getattr(config, name)
        if name == "window" and config.protocol is not None:
            continue   # a protocol's window: _check_protocol
        if value not in values:
            raise FastpplError(f"unknown {flag} {value!r}; use one of {', '.join(values)}")
    if config.protocol is not None and config.protocol not in PROTOCOL_WINDOWS:
        raise FastpplError(f"unknown --protocol {config.protocol!r}; use one of {', '.join(PROTOCOL_WINDOWS)}")


def _check_numbers(config: EvalConfig) -> None:
    if config.batch_size != "auto" and (not isinstance(config.batch_size, int) or config.batch_size < 1):
        raise FastpplError(f"--batch-size must be at least 1, got {config.batch_size}")
    for flag, value, minimum in (("--ctx", config.ctx, 2), ("--loss-chunk-rows", config.loss_chunk_rows, 1),
                                 ("--checkpoint-batches", config.checkpoint_batches, 1),
                                 ("--bootstrap-seed", config.bootstrap_seed, 0)):
        if value is not None and value < minimum:
            raise FastpplError(f"{flag} must be at least {minimum}, got {value}")
    seconds = config.checkpoint_seconds
    if seconds is not None and not seconds >= 0:   # also refuses NaN, which would never trigger a checkpoint
        raise FastpplError(f"--checkpoint-seconds must be a number >= 0, got {seconds}")
    if config.bootstrap != 0 and not (isinstance(config.bootstrap, int) and config.bootstrap >= MIN_BOOTSTRAP):
        # fewer resamples put the 2.5 % and 97.5 % percentiles on a handful of values
        raise FastpplError(f"--bootstrap must be 0 (off) or at least {MIN_BOOTSTRAP}, got {config.bootstrap}")
    if config.bootstrap > MAX_BOOTSTRAP:
        raise FastpplError(f"--bootstrap must be at most {MAX_BOOTSTRAP:,}, got {config.bootstrap:,}; 10,000 "
                           "resamples give the interval's ends to about 1 % of its width")


def _check_names(config: EvalConfig) -> None:
    check_model_spec(config.model, "--model")
    check_model_spec(config.tokenizer, "--tokenizer")
    check_model_spec(config.reference_model, "--reference-model")
    if config.resume is not None and not config.resume.strip():   # else it would read as no --resume, silently
        raise FastpplError("--resume: empty path; give a directory for the checkpoint or leave --resume out")


def _check_protocol(config: EvalConfig) -> None:
    """A protocol fixes the windows, the BOS rule and how its corpus is read: options that would change them are
    refused."""
    window = PROTOCOL_WINDOWS[config.protocol]
    if config.window not in ("chunked", window):   # chunked: the default, left as it is
        raise FastpplError(f"--window {config.window} does not go with --protocol {config.protocol}, which fixes "
                           "its windows; drop --window")
    fixed = [flag for flag, given in (("--bos", config.bos), ("--kv-cache on", config.kv_cache == "on"),
                                      ("--stride", config.stride is not None and window != "sliding")) if given]
    if fixed:
        raise FastpplError(f"{fixed[0]} does not go with --protocol {config.protocol}, which fixes what it would "
                           f"change; drop {fixed[0]}")
    if config.id_field is not None or config.group_by is not None:
        raise FastpplError("--id-field and --group-by apply without --protocol (a protocol fixes how its corpus is "
                           "read); drop them or --protocol")


def _check_windows(config: EvalConfig) -> None:
    window = PROTOCOL_WINDOWS[config.protocol] if config.protocol is not None else config.window
    if window != "sliding":
        for flag, given, why in (("--stride", config.stride is not None, ""),
                                 ("--kv-cache on", config.kv_cache == "on", " (chunked windows share no tokens)"),
                                 ("--bos", config.bos, " (chunked windows always start with BOS)")):
            if given:
                raise FastpplError(f"{flag} applies to --window sliding only{why}")
    if config.kv_cache != "on":
        return
    if config.batching != "auto":   # it would be ignored: the cached path makes its own rows
        raise FastpplError(f"--batching {config.batching} does not apply with --kv-cache on, which scores a row "
                           "per document; drop one of them")
    if config.resume is not None:   # the cached path scores a row per document, not the batches checkpoints count
        raise FastpplError("--resume does not work with --kv-cache on; drop one of them")


def _check_fields(config: EvalConfig) -> None:
    """--text-field, --id-field and --group-by name fields of records: given with no .jsonl or hf: --data,
    they would be ignored."""
    if any(s.startswith("hf:") or Path(s).suffix == ".jsonl" for s in config.data):
        return
    for flag, given in (("--text-field", config.text_field), ("--id-field", config.id_field),
                        ("--group-by", config.group_by)):
        if given is not None:
            raise FastpplError(f"{flag} applies to .jsonl files and hf: datasets, and no --data is one; drop it")


def _check_named_corpora(config: EvalConfig) -> None:
    """--data wikitext2 or c4: read as a protocol reads it, alone. Without --protocol, a file of that name is read
    as a file."""
    if config.protocol is None:
        named = [s for s in config.data if s in CORPUS_PROTOCOLS and not Path(s).exists()]
        if named:
            protocols = CORPUS_PROTOCOLS[named[0]]
            raise FastpplError(f"--data {named[0]} is a corpus of --protocol {' or '.join(protocols)}; add "
                               f"--protocol {protocols[0]} (it reads its file from --data-dir DIR, else the hub "
                               "through `datasets`)")
        return
    named = [s for s in config.data if s in CORPUS_PROTOCOLS]
    if named and (config.protocol not in CORPUS_PROTOCOLS[named[0]] or len(config.data) > 1):
        raise FastpplError(f"--data {named[0]} is a corpus of --protocol {' or '.join(CORPUS_PROTOCOLS[named[0]])}, "
                           "read alone; use that protocol and no other --data")
    if named and config.split != "all":
        raise FastpplError(f"--split {config.split} applies to a single text; use --split all with --data {named[0]}")


def _check_resume(config: EvalConfig) -> None:
    if config.resume is None and (config.checkpoint_seconds is not None or config.checkpoint_batches is not None):
        raise FastpplError("--checkpoint-seconds and --checkpoint-batches apply with --resume only; add --resume DIR")


def _check_reference(config: EvalConfig) -> None:
    if config.reference_model is None:
        for flag, given in (("--reference-seed", config.reference_seed),
                            ("--reference-device", config.reference_device)):
            if given is not None:
                raise FastpplError(f"{flag} applies with --reference-model only; add --reference-model or drop it")
        return
    if config.loss == "fused":
        raise FastpplError("--loss fused does not work with --reference-model (both models' divergence runs its own "
                           "kernel); drop --loss fused")
    if config.kv_cache == "on":
        raise FastpplError("--kv-cache on does not work with --reference-model (both models read the planned "
                           "windows whole, and cached windows read only their new tokens); drop --kv-cache on")


def _check_placement(config: EvalConfig) -> None:
    if config.max_gpu_memory is not None and not (isinstance(config.max_gpu_memory, int)
                                                  and config.max_gpu_memory >= 1):
        raise FastpplError(f"--max-gpu-memory must be a size such as 8GiB, got {config.max_gpu_memory!r}")
    if config.placement != "streamed" and not config.layer_error:
        return
    # --layer-error runs the streamed path too (fastppl.runner.choose_placement)
    path = "--placement streamed" if config.placement == "streamed" else "--layer-error"
    for flag, given, why in (
            ("--compile on", config.compile == "on", "compiles the resident forward"),
            ("--kv-cache on", config.kv_cache == "on", "keeps every layer's keys and values of a window at once"),
            ("--backend hf", config.backend == "hf", "runs the model through transformers"),
            ("--reference-device", config.reference_device is not None, "runs the reference on a device of its own")):
        if given:
            fix = "drop --layer-error" if config.layer_error else "use --placement resident"
            raise FastpplError(f"{flag} does not work with {path} (it {why}, and the streamed path runs a native "
                               f"model's blocks one at a time); drop {flag} or {fix}")


def _check_layer_error(config: EvalConfig) -> None:
    if not config.layer_error:
        return
    if config.reference_model is None:
        raise FastpplError("--layer-error compares the model's blocks with a reference model's; add "
                           "--reference-model (a model of the same architecture) or drop --layer-error")
    if config.placement == "resident":
        raise FastpplError("--layer-error runs on the layer-major path (both models block by block); drop "
                           "--placement resident")
    if config.resume is not None:
        raise FastpplError("--layer-error's sums are not checkpointed; drop --resume or --layer-error")


SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def memory_size(value: str, flag: str) -> int:
    """"8GiB", "8GB", "512MiB", "1.5G" or bytes -> bytes (KiB, MiB, GiB and a bare K, M, G: powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in SIZE_UNITS:
        raise FastpplError(f"{flag} must be a size such as 8GiB, 500MiB or a number of bytes, got {value!r}")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).lower()])
