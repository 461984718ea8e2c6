"""Corpora: a UTF-8 text file (one document), a .jsonl file (one document per line), a .npy file of token
ids (one pre-tokenised document), a built-in, or a document set (a directory of files, a Hugging Face
dataset split)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from ..config import cache_dir, data_directories
from ..errors import FastpplError, Unreachable, check_input_file, first_line, is_link_loop, is_unreachable, no_such
from .hf_datasets import check_texts, load_hf_dataset
from .jsonl import json_lines


@dataclass(frozen=True)
class Document:
    id: str      # "path" for a text file; a .jsonl line's id field, else "path:line"
    text: str
    # (n,) int64 ids of a pre-tokenised document (.npy), which the pipeline scores as they are; its text
    # is then "" until the pipeline decodes the ids, for bytes and words
    token_ids: Optional[np.ndarray] = field(default=None, compare=False, repr=False)
    group: Optional[str] = None   # the --group-by field's value (.jsonl, hf:), for per-group results
    # the text whose words and bytes the metrics count, where a protocol scores a rewritten text (lm-eval's
    # wikitext task scores the detokenized page and counts the original); None: text itself
    counted_text: Optional[str] = field(default=None, compare=False, repr=False)

    @property
    def text_counted(self) -> str:
        return self.text if self.counted_text is None else self.counted_text


@dataclass(frozen=True)
class Fields:
    """Which fields of a .jsonl line or hf: row hold the text, the document's id and its group."""
    text: str = "text"
    id: Optional[str] = None      # None: a field "id" where there is one (and unique), else the line or row
    group: Optional[str] = None   # None: no groups


def _scalar_field(record: dict, name: str, where: str, flag: str) -> str:
    """A record's id or group value as text: a string or a number, not a list, object, bool or null."""
    if name not in record:
        raise FastpplError(f"{where}: no field {name!r}; every record needs one, or pick another with {flag}")
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise FastpplError(f"{where}: field {name!r} is {json.dumps(value)[:40]}, not a string or number; "
                           f"pick another field with {flag}")
    return str(value)


def _record_document(record: dict, where: str, fallback_id: str, fields: Fields) -> Document:
    """The document of one .jsonl line or hf: row (its text already checked)."""
    if fields.id is not None:
        doc_id = _scalar_field(record, fields.id, where, "--id-field")
    elif isinstance(record.get("id"), (str, int)) and not isinstance(record.get("id"), bool):
        doc_id = str(record["id"])
    else:
        doc_id = fallback_id
    group = _scalar_field(record, fields.group, where, "--group-by") if fields.group is not None else None
    return Document(id=doc_id, text=record[fields.text], group=group)


def unique_ids(documents: list["Document"], fallback_ids: list[str], source: str,
               fields: Fields) -> list["Document"]:
    """Per-document results are keyed by id: two documents of one source may not share one. Ids of --id-field
    must be unique; where a default "id" field repeats, the lines' (or rows') own ids are used instead."""
    seen = {}
    for number, document in enumerate(documents):
        if document.id in seen:
            if fields.id is None:
                return [dataclasses.replace(d, id=fallback) for d, fallback in zip(documents, fallback_ids)]
            raise FastpplError(f"{source}: documents {seen[document.id] + 1} and {number + 1} (counting from 1) share "
                               f"the id {document.id!r}; pass --id-field naming a field that is unique")
        seen[document.id] = number
    return documents


def path_id(path: Path) -> str:
    """A path as a document id that any JSON parser reads: a file name's bytes that are not UTF-8 (which Python
    holds as lone surrogates, refused by strict parsers) are written as \\xNN escapes."""
    return str(path).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def corpus_sha256(documents) -> str:
    """sha256 of what the documents hold, in order (texts, or the ids of pre-tokenised ones), not of their ids or
    paths: the same text reached by another path or as the built-in corpus gives the same value, so that
    `fastppl compare` can tell the same corpus from another one."""
    digest = hashlib.sha256()
    for document in documents:
        raw = (b"ids:" + document.token_ids.astype("<i8").tobytes() if document.token_ids is not None
               else b"text:" + document.text.encode("utf-8", errors="surrogatepass"))
        digest.update(len(raw).to_bytes(8, "little"))
        digest.update(raw)
    return digest.hexdigest()


@dataclass(frozen=True)
class BuiltinCorpus:
    filename: str
    url: str
    n_bytes: int
    sha256: str


BUILTINS = {
    "tinyshakespeare": BuiltinCorpus(
        filename="tinyshakespeare.txt",
        url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
        n_bytes=1_115_394,
        sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
    ),
}


def split_text(text: str, split: str) -> str:
    """nanoGPT's split: the first 90 % of the characters are train, the last 10 % val."""
    cut = int(len(text) * 0.9)
    return {"train": text[:cut], "val": text[cut:], "all": text}[split]


def decode_utf8(raw: bytes, name: str, errors: str) -> str:
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise FastpplError(
            f"{name}: byte {e.start} (0x{raw[e.start]:02x}) is not valid UTF-8; "
            "fix the file or pass --errors replace to substitute U+FFFD"
        ) from None


# a document's bytes, its text (up to 4 bytes a character) and its ids (int64, plus a copy while they are joined)
# are held at once: a file is refused when this many times its size exceeds the memory available
MEMORY_PER_FILE_BYTE = 8


def available_memory_bytes() -> Optional[int]:
    """The memory a new allocation can have without swapping (Linux's MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _too_large(path: Path, n_bytes: int, limit: int) -> FastpplError:
    return FastpplError(f"{path}: {n_bytes:,} bytes or more is too large to tokenise in this machine's memory "
                        f"(up to {limit:,} bytes here); split it into smaller files or a .jsonl of documents")


# NUL is no character of any text: a file holding one is binary (or a sparse file of zeros), refused before it is
# read whole; its first block tells at once for most such files
FIRST_BLOCK = 1 << 16


def _binary(path: Path, offset: int) -> FastpplError:
    return FastpplError(f"{path}: holds a NUL byte (at byte {offset:,}), so it is binary, not text; pass a UTF-8 "
                        "text file (.txt or .jsonl), or a .npy of token ids")


def read_bytes(path: Path, text: bool = True) -> bytes:
    """A regular file's bytes, refused (one line) when it cannot be held and tokenised in memory, or, for a text
    file (not a compressed one: text=False), when it holds a NUL byte (binary)."""
    if not path.exists():
        raise FastpplError(f"{path}: {no_such(path)}; check the --data path")
    if path.is_dir():
        raise FastpplError(f"{path}: is a directory; pass a .txt or .jsonl file")
    check_input_file(path, "pass a .txt or .jsonl file")
    available = available_memory_bytes()
    limit = available // MEMORY_PER_FILE_BYTE if available else None
    try:
        with open(path, "rb") as f:
            first = f.read(FIRST_BLOCK)
            if text and b"\0" in first:
                raise _binary(path, first.index(b"\0"))
            size = os.fstat(f.fileno()).st_size
            if limit is not None and size > limit:
                raise _too_large(path, size, limit)
            raw = first + f.read()
    except MemoryError:
        raise _too_large(path, path.stat().st_size, limit or 0) from None
    except OSError as e:
        raise FastpplError(f"{path}: cannot be read ({e.strerror or first_line(e)})") from None
    if limit is not None and len(raw) > limit:   # grown since it was measured
        raise _too_large(path, len(raw), limit)
    if text and b"\0" in raw:
        raise _binary(path, raw.index(b"\0"))
    return raw


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download(url: str, dest: Path, expected_sha256: str) -> None:
    """Download to a temporary file beside dest, verify, then rename: no partial file is ever left."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=30) as response:
            shutil.copyfileobj(response, out)
        if _sha256(Path(tmp)) != expected_sha256:
            raise FastpplError(f"download of {url} does not match its sha256; try again later")
        os.replace(tmp, dest)
    except OSError as e:
        error = Unreachable if is_unreachable(e) else FastpplError
        raise error(
            f"cannot download {url} ({getattr(e, 'reason', e)}); offline, put the file in a directory "
            "and pass --data-dir DIR (or set FASTPPL_DATA_DIR), or pass --data PATH"
        ) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def builtin_path(name: str, data_dir: Optional[str]) -> Path:
    """A verified local copy of a built-in corpus: --data-dir, FASTPPL_DATA_DIR, the cache, else download."""
    corpus = BUILTINS[name]
    candidates = data_directories(data_dir)
    for directory in candidates:
        path = Path(directory) / corpus.filename
        if path.exists():
            if path.stat().st_size != corpus.n_bytes or _sha256(path) != corpus.sha256:
                raise FastpplError(f"{path}: is not the {name} corpus (size or sha256 differ); replace it")
            return path
    if candidates:
        settings = (("--data-dir", data_dir), ("FASTPPL_DATA_DIR", os.environ.get("FASTPPL_DATA_DIR")))
        given = " and ".join(what for what, value in settings if value)
        raise FastpplError(
            f"{name}: no {corpus.filename} in {', '.join(candidates)}; put the file there or drop {given}"
        )
    cached = cache_dir() / "data" / corpus.filename
    if not (cached.exists() and _sha256(cached) == corpus.sha256):
        _download(corpus.url, cached, corpus.sha256)
    return cached


# json.loads joins an escaped surrogate pair into one character: a surrogate left in its result is alone
_SURROGATE = re.compile("[\ud800-\udfff]")


def jsonl_documents(raw_text: str, path: Path, fields: Fields) -> list[Document]:
    documents, fallback_ids, text_field = [], [], fields.text
    for line_number, record in json_lines(raw_text, path, "fix the line"):
        if not isinstance(record, dict) or text_field not in record:
            raise FastpplError(
                f"{path}:{line_number}: no field {text_field!r}; pass --text-field NAME"
            )
        if not isinstance(record[text_field], str):
            raise FastpplError(f"{path}:{line_number}: field {text_field!r} is not a string; pick the text field "
                               "with --text-field")
        lone = _SURROGATE.search(record[text_field])
        if lone:   # a JSON escape such as \ud800 without its pair: no UTF-8 (and no tokenizer) can encode it
            raise FastpplError(f"{path}:{line_number}: field {text_field!r} holds a lone surrogate "
                               f"(\\u{ord(lone.group()):04x} at character {lone.start():,}), which is not valid "
                               "Unicode; fix the line")
        fallback_ids.append(f"{path_id(path)}:{line_number}")
        documents.append(_record_document(record, f"{path}:{line_number}", fallback_ids[-1], fields))
    return unique_ids(documents, fallback_ids, str(path), fields)


def token_id_document(path: Path) -> Document:
    """A .npy file of token ids (1-D, integers, made by the model's tokenizer) as one document."""
    if not path.exists():
        raise FastpplError(f"{path}: {no_such(path)}; check the --data path")
    check_input_file(path, "pass a .npy file saved by numpy.save")
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        # numpy's own reason names allow_pickle for any file it does not recognise, which misleads here
        raise FastpplError(f"{path}: is not a NumPy .npy array of token ids; save the ids with numpy.save, or "
                           "pass the text as a .txt file") from None
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise FastpplError(f"{path}: holds {ids.dtype} of shape {ids.shape}; a .npy corpus is a 1-D array of token ids")
    if ids.size == 0:
        raise FastpplError(f"{path}: holds no token ids; a .npy corpus needs at least 2")
    if ids.min() < 0:
        raise FastpplError(f"{path}: holds a negative token id ({ids.min()}); the ids must come from the model's "
                           "tokenizer")
    if ids.max() > np.iinfo(np.int64).max:   # uint64 beyond int64 would wrap to negative ids
        raise FastpplError(f"{path}: holds a token id ({ids.max()}) too large for any vocabulary")
    return Document(id=path_id(path), text="", token_ids=ids.astype(np.int64))


# Document sets beyond one file. A directory: every regular file under it, recursively, sorted by its path
# relative to the directory (hidden files and directories, whose names start with '.', are left out); each file
# is one document, read as UTF-8 without newline translation (CRLF stays CRLF); empty files are empty documents
# (skipped when scoring). --data hf:NAME[:CONFIG]:SPLIT reads one split through the `datasets` package.
HF_PREFIX = "hf:"


def directory_documents(directory: Path, errors: str = "strict") -> list[Document]:
    visible = [p for p in directory.rglob("*")
               if not any(part.startswith(".") for part in p.relative_to(directory).parts)]
    broken = [p for p in visible if p.is_symlink() and not p.exists()]
    if broken:   # not skipped in silence: a document the user meant to score would be missing
        what = "a loop of symbolic links" if is_link_loop(broken[0]) else "a link to nothing"
        raise FastpplError(f"{path_id(broken[0])}: {what}; remove it or point it at a file")
    for member in visible:   # a FIFO, device or socket: refused, as a file that cannot be read would be
        if not member.is_dir():
            check_input_file(member, f"remove it from {directory}, which holds one document per file")
    files = sorted((p for p in visible if p.is_file()), key=lambda p: p.relative_to(directory).as_posix())
    if not files:
        raise FastpplError(f"{directory}: holds no files; put one text file per document in it")
    return [Document(id=path_id(p), text=decode_utf8(read_bytes(p), str(p), errors)) for p in files]


def _split_outside_brackets(text: str) -> list[str]:
    """'a:b:test[:10%]' -> ['a', 'b', 'test[:10%]']: a split may slice with a colon inside brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += (char == "[") - (char == "]")
        if char == ":" and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return parts + [current]


def parse_hf_source(source: str) -> tuple[str, Optional[str], str]:
    """'hf:NAME[:CONFIG]:SPLIT' -> (name, config or None, split)."""
    assert source.startswith(HF_PREFIX)
    parts = _split_outside_brackets(source[len(HF_PREFIX):])
    if len(parts) not in (2, 3) or not all(parts):
        raise FastpplError(
            f"--data {source}: write hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT, "
            "e.g. hf:EleutherAI/wikitext_document_level:wikitext-2-raw-v1:test"
        )
    if len(parts) == 2:
        return parts[0], None, parts[1]
    return parts[0], parts[1], parts[2]


def _check_columns(label: str, columns: list[str], fields: "Fields") -> None:
    for name, flag in ((fields.text, "--text-field"), (fields.id, "--id-field"), (fields.group, "--group-by")):
        if name is not None and name not in columns:
            raise FastpplError(f"{label}: no field {name!r}; its fields are {', '.join(columns)}; pass {flag} NAME")


def hf_documents(source: str, fields: Fields) -> list[Document]:
    name, config, split = parse_hf_source(source)
    label = f"--data {source}"
    dataset = load_hf_dataset(label, name, config, split)
    columns = list(dataset.column_names)
    _check_columns(label, columns, fields)
    # the columns a document needs, read column by column (a dataset reads a column at once, not row by row)
    wanted = [c for c in dict.fromkeys((fields.text, fields.id or "id", fields.group)) if c in columns]
    values = {c: dataset[c] for c in wanted}
    check_texts(label, values[fields.text], fields.text)
    documents = [_record_document({c: values[c][row] for c in wanted}, f"{label}: row {row}", f"{source}:{row}", fields)
                 for row in range(len(values[fields.text]))]
    return unique_ids(documents, [f"{source}:{row}" for row in range(len(documents))], label, fields)


def load_documents(
    source: str, split: str = "all", text_field: str = "text",
    data_dir: Optional[str] = None, errors: str = "strict", fields: Optional[Fields] = None,
) -> list[Document]:
    """Documents of one --data argument. A split applies to a single text (train/val of its characters);
    fields (default: the text in text_field) pick a .jsonl line's or hf: row's text, id and group."""
    fields = fields or Fields(text=text_field)
    if fields.group is not None and not (source.startswith(HF_PREFIX) or Path(source).suffix == ".jsonl"):
        raise FastpplError(f"--group-by applies to .jsonl files and hf: datasets, and --data {source} is neither; "
                           "drop --group-by or pass .jsonl / hf: corpora")
    if source.startswith(HF_PREFIX) or Path(source).is_dir():
        if split != "all":
            raise FastpplError(f"--split {split} applies to a single text; use --split all with {source}")
        if source.startswith(HF_PREFIX):
            return hf_documents(source, fields)
        return directory_documents(Path(source), errors)
    if source in BUILTINS:
        path = builtin_path(source, data_dir)
        text = decode_utf8(read_bytes(path), str(path), errors)
        return [Document(id=source, text=split_text(text, split))]
    path = Path(source)
    if path.suffix == ".npy":
        if split != "all":
            raise FastpplError("--split train/val applies to a text; use --split all with a .npy of token ids")
        return [token_id_document(path)]
    if not path.exists() and "/" not in source and "." not in source:
        raise FastpplError(
            f"{source!r}: not a file and not a built-in corpus ({', '.join(BUILTINS)}); check --data"
        )
    text = decode_utf8(read_bytes(path), str(path), errors)
    if not text.strip():   # str.strip, so Unicode spaces (U+3000, no-break space) count as whitespace too
        raise FastpplError(f"{path}: is empty (or whitespace only); pass a file with text in it")
    if path.suffix == ".jsonl":
        if split != "all":
            raise FastpplError("--split train/val applies to a single text; use --split all with .jsonl")
        documents = jsonl_documents(text, path, fields)
        if not documents:
            raise FastpplError(f"{path}: holds no documents")
        return documents
    return [Document(id=path_id(path), text=split_text(text, split))]


def _source_key(source: str) -> str:
    """What a --data argument reads: the resolved file or directory, else the name (hf:, a built-in)."""
    path = Path(source).expanduser()
    return str(path.resolve()) if not source.startswith(HF_PREFIX) and path.exists() else source


def check_sources_distinct(sources: list[str]) -> None:
    """Each --data source once: one given twice would score its documents twice under the same ids, which
    per-document results (keyed by id) cannot tell apart."""
    seen: dict[str, str] = {}
    for source in sources:
        key = _source_key(source)
        if key in seen:
            also = "" if seen[key] == source else f" (as {seen[key]} and {source})"
            raise FastpplError(f"--data {source} is given twice{also}; give each corpus once")
        seen[key] = source


def corpus_documents(sources: list[str], split: str, data_dir: Optional[str], errors: str,
                     fields: Fields) -> list[Document]:
    """The documents of every --data source, in order, under ids unique across the sources."""
    check_sources_distinct(sources)
    documents, source_of = [], {}
    for source in sources:
        for document in load_documents(source, split, data_dir=data_dir, errors=errors, fields=fields):
            first = source_of.setdefault(document.id, source)
            if first != source:   # two sources' "id" fields, or a directory and a file inside it
                raise FastpplError(
                    f"--data {first} and --data {source} both hold a document with the id {document.id!r}; "
                    "per-document results are keyed by id: pass --id-field naming a field unique across them, "
                    "or give each document once")
            documents.append(document)
    return documents
