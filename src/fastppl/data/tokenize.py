"""Tokenizer loading and tokenisation with an on-disk cache of token ids."""
from __future__ import annotations

import copy
import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ..config import cache_dir, gguf_spec, is_path_like, local_gpt2_tokenizer
from ..errors import (FastpplError, Unreachable, check_directory_members, check_input_file, first_line, is_link_loop,
                      is_unreachable, no_such)
from . import pieces
from .pieces import encode_in_pieces, encode_short_texts
from .token_cache import entry_path, read_entry, text_sha256, warn, write_entry


@dataclass
class Tokenizer:
    """The few things scoring needs from a tokenizer: a `tokenizers` (Rust) tokenizer and its specials."""
    backend: object          # a tokenizers.Tokenizer
    name: str
    fingerprint: str         # changes whenever the mapping text -> ids could change
    bos_id: Optional[int]    # BOS, else end-of-text: what lm-evaluation-harness conditions on
    eos_id: Optional[int]
    vocab_size: int          # ids are < vocab_size
    # why a long text was tokenised in one piece, not in parallel (fastppl.data.pieces); None while none was
    whole_text_reason: Optional[str] = None
    texts_from_cache: int = 0   # texts whose ids the token cache gave (how they were cut is not known then)
    texts_encoded: int = 0

    def __post_init__(self):
        # every token of a text is scored: a tokenizer.json that truncates or pads (set for a classifier's inputs)
        # would drop ids, or add pads to the pieces encoded together
        self.backend.no_truncation()
        self.backend.no_padding()

    def encode(self, text: str) -> np.ndarray:
        """The ids of one `encode` of the whole text (no special tokens added), computed in parallel pieces."""
        encoded = self._call_backend(encode_in_pieces, text, len(text))
        if encoded.whole_reason:
            self.whole_text_reason = encoded.whole_reason
        return encoded.ids

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        """encode() of each text; the short ones (a piece each) together, on all cores."""
        short = [i for i, text in enumerate(texts) if len(text) < 2 * pieces.PIECE_CHARS]
        ids = dict(zip(short, self._call_backend(encode_short_texts, [texts[i] for i in short],
                                                 max((len(texts[i]) for i in short), default=0))))
        return [ids[i] if i in ids else self.encode(text) for i, text in enumerate(texts)]

    def _call_backend(self, function, texts, n_chars: int):
        try:
            return function(self.backend, texts)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:   # the Rust side's errors; a panic there is a BaseException (pyo3's)
            raise FastpplError(f"the tokenizer cannot encode a text of {n_chars:,} characters ({first_line(e)}); "
                               "split it into smaller documents (.jsonl, or a directory of files)") from None

    def with_specials_as_text(self) -> Tokenizer:
        """A copy that reads a special token's spelling in a text ("<|endoftext|>") as text, as llama.cpp tokenizes
        without parse_special (a user-defined, not special, added token is still matched); its own fingerprint keeps
        the token cache's entries apart."""
        backend = copy.deepcopy(self.backend)
        backend.encode_special_tokens = True
        fingerprint = hashlib.sha256(f"{self.fingerprint} specials as text".encode()).hexdigest()[:16]
        return dataclasses.replace(self, backend=backend, fingerprint=fingerprint)

    def decode(self, ids) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def n_bytes(self, ids) -> int:
        return len(self.decode(ids).encode("utf-8"))

    def default_prefix(self) -> Optional[int]:
        """The token the tokenizer puts before a text by default (Llama's BOS), or None (GPT-2's puts none):
        what `tokenizer(text)` in transformers and llama.cpp's tokenizer prepend. A tokenizer that adds more
        (several tokens, or one after the text) is refused: the protocols that use this rule add one BOS."""
        plain = self.backend.encode("a", add_special_tokens=False).ids
        full = self.backend.encode("a", add_special_tokens=True).ids
        added = len(full) - len(plain)
        if added > 1 or full[added:] != plain:
            raise FastpplError(f"tokenizer {self.name!r} adds {full} around a text's {plain} by default, not one BOS "
                               "in front; this protocol needs a tokenizer that adds one BOS or nothing")
        return full[0] if added else None

    def token_n_bytes(self, ids: np.ndarray, i: int) -> int:
        """UTF-8 bytes that token ids[i] adds to the decoded text. Decoded after up to 8 tokens of left
        context, not alone, because decoders treat the start of a text specially (SentencePiece drops
        the leading space of its first token)."""
        left = max(i - 8, 0)
        return self.n_bytes(ids[left:i + 1].tolist()) - self.n_bytes(ids[left:i].tolist())


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether two tokenizers map text to ids alike: the token cache's fingerprints (of the file read, or of the
    tokenizer), else, where they were read by different routes, the fingerprints of the tokenizers themselves."""
    return a.fingerprint == b.fingerprint or _fingerprint(a.backend) == _fingerprint(b.backend)


def _fingerprint(backend) -> str:
    return hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()[:16]


def _file_fingerprint(path: Path, added: Optional[list] = None) -> str:
    """The fingerprint of a tokenizer read from `path` (and the added tokens put on top of it): its bytes and the
    library that reads them. Hashing the file is cheaper than serialising the tokenizer again (0.13 s on a 16-core
    host, for GPT-2's)."""
    import json

    import tokenizers
    digest = hashlib.sha256(f"tokenizers {tokenizers.__version__}\n".encode())
    digest.update(path.read_bytes())
    if added:
        digest.update(json.dumps(added, sort_keys=True).encode())
    return digest.hexdigest()[:16]


ADDED_TOKEN_FLAGS = ("lstrip", "rstrip", "single_word", "normalized", "special")


def _has_flags(token, entry: dict) -> bool:
    return token is not None and token.content == entry["content"] and all(
        getattr(token, flag) == entry[flag] for flag in ADDED_TOKEN_FLAGS)


def _add_config_tokens(directory: Path, config: dict, backend) -> Optional[list]:
    """The added tokens that tokenizer_config.json declares (added_tokens_decoder) and tokenizer.json lacks, or
    holds with other flags, added to backend as transformers adds them (in id order, special ones as special, with
    the declared flags). Returns those entries ([] when none), or None where transformers must load the tokenizer:
    an added_tokens.json, additional special tokens the file lacks, or a token that would not land at its
    declared id (what transformers does then is its own)."""
    from tokenizers import AddedToken
    declared = config.get("added_tokens_decoder") or {}
    present = backend.get_added_tokens_decoder()
    extra = config.get("additional_special_tokens") or []
    if (directory / "added_tokens.json").exists() or not isinstance(declared, dict) or any(
            (token.get("content") if isinstance(token, dict) else token) not in
            {t.content for t in present.values()} | {e.get("content") for e in declared.values()} for token in extra):
        return None
    try:
        entries = sorted(((int(key), entry) for key, entry in declared.items()), key=lambda item: item[0])
        added = [entry for key, entry in entries if not _has_flags(present.get(key), entry)]
        for entry in added:
            token = AddedToken(entry["content"], **{flag: bool(entry[flag]) for flag in ADDED_TOKEN_FLAGS})
            (backend.add_special_tokens if entry["special"] else backend.add_tokens)([token])
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    now = backend.get_added_tokens_decoder()
    return added if all(_has_flags(now.get(key), entry) for key, entry in entries) else None


def _special_token(config: dict, key: str):
    value = config.get(key)
    return value.get("content") if isinstance(value, dict) else value


# GPT-2's tokenizer classes default bos, eos and unk to this token when no file names them; the hub's own gpt2
# tokenizer_config.json holds only {"model_max_length": 1024}
GPT2_END_OF_TEXT = "<|endoftext|>"


def _special_ids(directory: Path, config: dict, backend) -> dict:
    """{"bos_token": id or None, "eos_token": id or None}, where transformers finds them: tokenizer_config.json,
    then special_tokens_map.json, then (GPT-2's classes, or no class named) GPT-2's default <|endoftext|>."""
    import json
    try:
        special_map = json.loads((directory / "special_tokens_map.json").read_text())
    except (OSError, ValueError):
        special_map = {}
    gpt2_class = config.get("tokenizer_class") in (None, "GPT2Tokenizer", "GPT2TokenizerFast")
    ids = {}
    for key in ("bos_token", "eos_token"):
        token = _special_token(config, key) or (_special_token(special_map, key) if isinstance(special_map, dict)
                                                 else None)
        if token is None and gpt2_class:
            token = GPT2_END_OF_TEXT
        ids[key] = backend.token_to_id(token) if isinstance(token, str) else None
    return ids


# classes whose tokenizer is tokenizer.json as saved (transformers 5 saves a plain one as TokenizersBackend); other
# classes (LlamaTokenizer, ...) may rebuild it from the vocabulary with a pipeline of their own, so transformers
# loads them. add_bos_token / add_eos_token only add specials, which scoring never asks the tokenizer for.
TOKENIZER_JSON_CLASSES = (None, "GPT2Tokenizer", "GPT2TokenizerFast", "PreTrainedTokenizerFast", "TokenizersBackend")


def _load_tokenizer_json(directory: Path, name: str) -> Optional[Tokenizer]:
    """A local tokenizer.json read by `tokenizers` alone: about 0.1 s, where transformers' AutoTokenizer
    took 6.8 s on a 16-core host (its import, then rebuilding the tokenizer).
    Added tokens that tokenizer_config.json declares are put on top, as transformers puts them. None when the
    directory's tokenizer_config.json asks for more than that (a custom class, or other options that transformers
    applies on top of tokenizer.json), so transformers loads it instead."""
    import json
    from tokenizers import Tokenizer as RustTokenizer

    config_path = directory / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        backend = RustTokenizer.from_file(str(directory / "tokenizer.json"))
        fingerprint = _file_fingerprint(directory / "tokenizer.json")
    except Exception:   # unreadable or unusual: let transformers try, and report its error
        return None
    if config.get("tokenizer_class") not in TOKENIZER_JSON_CLASSES or config.get("add_prefix_space"):
        return None
    added = _add_config_tokens(directory, config, backend)
    if added is None:
        return None
    if added:
        fingerprint = _file_fingerprint(directory / "tokenizer.json", added)
    ids = _special_ids(directory, config, backend)
    bos_id = ids["bos_token"] if ids["bos_token"] is not None else ids["eos_token"]
    return Tokenizer(backend=backend, name=name, fingerprint=fingerprint, bos_id=bos_id,
                     eos_id=ids["eos_token"], vocab_size=backend.get_vocab_size(with_added_tokens=True))


def _load_vocab_merges(directory: Path, name: str) -> Optional[Tokenizer]:
    """GPT-2's original layout, vocab.json + merges.txt without tokenizer.json: a byte-level BPE as GPT-2 defines it
    (no prefix space), with <|endoftext|> as its special token when the vocabulary has it (BOS and EOS). None if the
    files cannot be read that way, so that transformers may try."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer
    try:
        backend = RustTokenizer(models.BPE.from_file(str(directory / "vocab.json"), str(directory / "merges.txt")))
    except Exception:
        return None
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    end_of_text = backend.token_to_id(GPT2_END_OF_TEXT)
    if end_of_text is not None:
        backend.add_special_tokens([AddedToken(GPT2_END_OF_TEXT, special=True, normalized=False)])
    return Tokenizer(backend=backend, name=name, fingerprint=_fingerprint(backend), bos_id=end_of_text,
                     eos_id=end_of_text, vocab_size=backend.get_vocab_size(with_added_tokens=True))


# what transformers may read to build a tokenizer: fast or slow files, sentencepiece models, and config.json
# (some tokenizer_config.json files leave the tokenizer class to the model's config)
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "*.model", "*.tiktoken", "config.json"]


def _hub_tokenizer_dir(repo_id: str) -> Path:
    """The tokenizer files of a hub model, downloaded once into the Hugging Face cache or found there offline."""
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo_id, allow_patterns=TOKENIZER_FILES))
    except Exception as e:   # transformers would only try the hub again, with slow retries
        if is_unreachable(e):
            raise Unreachable(f"tokenizer {repo_id!r}: not a local directory, and the hub is unreachable "
                              f"({first_line(e)}); pass --tokenizer DIR, a local tokenizer directory") from None
        raise FastpplError(f"unknown tokenizer {repo_id!r}: not a local directory, and the hub did not serve it "
                           f"({first_line(e)}); pass --tokenizer DIR, a local tokenizer directory") from None


def _check_settings_files(directory: Path) -> None:
    """tokenizer_config.json and special_tokens_map.json, where valid JSON, hold an object: transformers fails on
    another with an AttributeError. (Invalid JSON is left to the loaders, which say so.)"""
    import json
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            settings = json.loads((directory / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(settings, dict):
            raise FastpplError(f"{directory / name}: holds a JSON {type(settings).__name__}, not an object of "
                               "settings; the tokenizer is corrupt, or pass --tokenizer PATH to another")


def load_tokenizer(name_or_path: str, offline_hint: str = "") -> Tokenizer:
    if gguf_spec(name_or_path):   # a GGUF file's own tokenizer, from its metadata
        from .gguf_tokenizer import gguf_tokenizer_fields
        return Tokenizer(name=name_or_path, **gguf_tokenizer_fields(name_or_path))
    directory = Path(name_or_path).expanduser()
    if directory.is_file():
        raise FastpplError(f"{name_or_path}: is a file; --tokenizer takes a tokenizer directory (tokenizer.json, "
                           "or vocab.json + merges.txt)")
    if directory.exists() and not directory.is_dir():   # a FIFO, a device: refused as not a regular file
        check_input_file(directory, "--tokenizer takes a tokenizer directory")
    if (is_path_like(name_or_path) or is_link_loop(directory)) and not directory.exists():
        raise FastpplError(f"{name_or_path}: {no_such(directory, 'tokenizer directory')}; check --tokenizer")
    if not directory.exists():
        directory = _hub_tokenizer_dir(name_or_path)
    check_directory_members(directory, "remove it from the tokenizer directory, or check --tokenizer")
    _check_settings_files(directory)
    if (directory / "tokenizer.json").is_file():
        fast = _load_tokenizer_json(directory, name_or_path)
        if fast is not None:
            return fast
    elif (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file() and not any(
            (directory / f).exists() for f in ("tokenizer_config.json", "special_tokens_map.json")):
        # the bare files (transformers 5 does not build a tokenizer from them alone)
        fast = _load_vocab_merges(directory, name_or_path)
        if fast is not None:
            return fast
    from transformers import AutoTokenizer

    from ..quiet import quiet_transformers
    try:
        with quiet_transformers():   # e.g. a model config's warnings about its special ids, read on the way
            hf = AutoTokenizer.from_pretrained(str(directory), use_fast=True)
    except Exception as e:  # transformers raises many types for missing/offline/corrupt tokenizers
        raise FastpplError(
            f"cannot load tokenizer {name_or_path!r} ({first_line(e)}); "
            f"pass --tokenizer PATH to a local tokenizer directory{offline_hint}"
        ) from None
    if len(hf.get_vocab()) <= len(set(hf.all_special_ids)):
        # transformers builds an empty tokenizer from a model directory that holds no tokenizer files
        raise FastpplError(
            f"{name_or_path}: holds no tokenizer vocabulary; pass --tokenizer PATH to a tokenizer directory"
            f"{offline_hint}"
        )
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise FastpplError(f"tokenizer {name_or_path!r} has no fast (Rust) implementation; "
                           "convert it to tokenizer.json")
    bos_id = hf.bos_token_id if hf.bos_token_id is not None else hf.eos_token_id
    return Tokenizer(backend=backend, name=name_or_path, fingerprint=_fingerprint(backend), bos_id=bos_id,
                     eos_id=hf.eos_token_id, vocab_size=len(hf))


CACHED_CHARS = 4096   # shorter texts tokenise faster than a file round trip


def _cached_ids(tokenizer: Tokenizer, path: Path, text_digest: str) -> Optional[np.ndarray]:
    ids = read_entry(path, tokenizer.fingerprint, text_digest)
    if ids is not None and ids.size and not 0 <= ids.min() <= ids.max() < tokenizer.vocab_size:
        warn(f"token cache entry {path} holds ids outside the tokenizer's {tokenizer.vocab_size:,}; tokenising again")
        return None
    return ids


def encode_documents(tokenizer: Tokenizer, texts: list[str], use_cache: bool = True) -> list[np.ndarray]:
    """Token ids of each text, from the cache when the same tokenizer has seen the same text before (a verified
    entry: fastppl.data.token_cache; one that does not verify is tokenised again and rewritten). The texts the
    cache does not hold are tokenised together (Tokenizer.encode_many)."""
    entries: list[Optional[tuple[Path, str]]] = [None] * len(texts)   # (path, text digest) of the cached texts
    for i, text in enumerate(texts):
        if use_cache and len(text) >= CACHED_CHARS:
            digest = text_sha256(text)
            entries[i] = (entry_path(cache_dir(), tokenizer.fingerprint, digest), digest)
    ids = [_cached_ids(tokenizer, *entry) if entry else None for entry in entries]
    missing = [i for i, found in enumerate(ids) if found is None]
    tokenizer.texts_from_cache += len(texts) - len(missing)
    tokenizer.texts_encoded += len(missing)
    for i, encoded in zip(missing, tokenizer.encode_many([texts[i] for i in missing]) if missing else []):
        ids[i] = encoded
        if entries[i]:
            path, digest = entries[i]
            write_entry(path, tokenizer.fingerprint, digest, encoded, tokenizer.vocab_size)
    return ids


def encode_cached(tokenizer: Tokenizer, text: str, use_cache: bool = True) -> np.ndarray:
    """Token ids of one text (encode_documents)."""
    return encode_documents(tokenizer, [text], use_cache)[0]


def check_ids_in_vocabulary(ids: np.ndarray, vocab_size: int, tokenizer_name: str) -> None:
    """Token ids index the model's embedding: one outside it is a user error, not an IndexError."""
    if ids.size and not 0 <= ids.min() <= ids.max() < vocab_size:
        bad = int(ids.max()) if ids.max() >= vocab_size else int(ids.min())
        raise FastpplError(f"tokenizer {tokenizer_name!r} gave token id {bad:,}, outside the model's vocabulary of "
                           f"{vocab_size:,}; pass the model's own tokenizer with --tokenizer")


def default_tokenizer_name(model_spec: str, data_dir: Optional[str] = None) -> str:
    """The model's own; random weights have none, and every preset's vocabulary holds GPT-2's: a data directory's
    gpt2-tokenizer folder (--data-dir, FASTPPL_DATA_DIR) where one has it, else the hub's gpt2."""
    if model_spec.startswith("random:"):
        return local_gpt2_tokenizer(data_dir) or "gpt2"
    return model_spec
