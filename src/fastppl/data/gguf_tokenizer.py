"""The tokenizer a GGUF file describes in its metadata (tokenizer.ggml.*), built by transformers' own GGUF
converter (the one AutoTokenizer.from_pretrained(..., gguf_file=...) uses), so that the ids are transformers'."""
from __future__ import annotations

import hashlib
from pathlib import Path

from ..config import gguf_local_path
from ..errors import FastpplError, first_line


def _converted(path: Path):
    """(tokenizers.Tokenizer, the tokenizer's settings: tokenizer.ggml.* renamed as transformers names them)."""
    try:   # transformers 5: a metadata reader of its own
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer
        architecture, settings, extra = get_gguf_tokenizer(str(path))
    except ImportError:   # transformers 4
        from transformers.integrations.ggml import convert_gguf_tokenizer
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
        parsed = load_gguf_checkpoint(str(path))
        architecture, settings, extra = parsed["config"]["model_type"], parsed["tokenizer"], parsed["tokenizer_config"]
    backend, _ = convert_gguf_tokenizer(architecture, settings)
    return backend, {**settings, **extra}


def gguf_tokenizer_fields(spec: str) -> dict:
    """The fields of a fastppl.data.tokenize.Tokenizer (all but its name) for a GGUF file's tokenizer."""
    path = gguf_local_path(spec, "--model or --tokenizer")
    try:
        backend, settings = _converted(path)
    except FastpplError:
        raise
    except Exception as e:   # a damaged file, or a tokenizer type transformers cannot build
        raise FastpplError(f"{path}: no tokenizer can be built from its GGUF metadata ({first_line(e)}); pass "
                           "--tokenizer PATH to the model's tokenizer directory") from None
    bos_id, eos_id = settings.get("bos_token_id"), settings.get("eos_token_id")
    _add_bos_as_llama_cpp_does(backend, bos_id if settings.get("add_bos_token") else None)
    fingerprint = hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()[:16]
    return dict(backend=backend, fingerprint=fingerprint, bos_id=bos_id if bos_id is not None else eos_id,
                eos_id=eos_id, vocab_size=backend.get_vocab_size(with_added_tokens=True))


def _add_bos_as_llama_cpp_does(backend, bos_id) -> None:
    """The text's default prefix (Tokenizer.default_prefix): BOS where the file's add_bos_token says so, as
    llama.cpp tokenizes, else nothing."""
    from tokenizers import processors
    if bos_id is None:
        if backend.encode("a", add_special_tokens=True).ids != backend.encode("a", add_special_tokens=False).ids:
            backend.post_processor = None
        return
    bos = backend.id_to_token(bos_id)
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, bos_id)])
