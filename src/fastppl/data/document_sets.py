"""Document sets beyond one file: a directory of text files, and a Hugging Face dataset split.

A directory: every regular file under it, recursively, sorted by its path relative to the directory
(hidden files and directories, whose names start with '.', are left out); each file is one document, read
as UTF-8 without newline translation (CRLF stays CRLF). Empty files are empty documents (skipped when scoring).

--data hf:NAME[:CONFIG]:SPLIT reads one split through the `datasets` package; --text-field names the column.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..errors import FastpplError, first_line
from .corpus import Document, decode_utf8, path_id, read_bytes

HF_PREFIX = "hf:"


def directory_documents(directory: Path, errors: str = "strict") -> list[Document]:
    visible = [p for p in directory.rglob("*")
               if not any(part.startswith(".") for part in p.relative_to(directory).parts)]
    broken = [p for p in visible if p.is_symlink() and not p.exists()]
    if broken:   # not skipped in silence: a document the user meant to score would be missing
        raise FastpplError(f"{path_id(broken[0])}: a link to nothing; remove it or point it at a file")
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


def hf_documents(source: str, text_field: str) -> list[Document]:
    name, config, split = parse_hf_source(source)
    try:
        import datasets
    except ImportError:
        raise FastpplError(
            f"--data {source}: reading Hugging Face datasets needs the `datasets` package; "
            "pip install datasets, or export the split to a .jsonl file and pass that"
        ) from None
    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # datasets raises many types for offline, unknown names, configs and splits
        raise FastpplError(
            f"--data {source}: cannot load dataset {name!r} (config {config}, split {split}): {first_line(e)}; "
            "offline, it must already be in the datasets cache (HF_DATASETS_OFFLINE=1)"
        ) from None
    columns = list(dataset.column_names)
    if text_field not in columns:
        raise FastpplError(
            f"--data {source}: no field {text_field!r}; its fields are {', '.join(columns)}; pass --text-field NAME"
        )
    documents = []
    for row, text in enumerate(dataset[text_field]):
        if not isinstance(text, str):
            raise FastpplError(f"--data {source}: row {row}: field {text_field!r} is not a string; pick the text field with --text-field")
        documents.append(Document(id=f"{source}:{row}", text=text))
    if not documents:
        raise FastpplError(f"--data {source}: the split holds no rows")
    return documents
