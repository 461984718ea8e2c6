"""Named evaluation protocols (--protocol): each fixes how a published tool prepares the corpus, which tokens its
windows read and score, its BOS rule, what it does with the tail and what it divides by, so that fastppl gives
that tool's number. Each is a composition of fastppl's windows (fastppl.data.windows) and streams
(fastppl.data.streams); this module holds the table and the corpus preparation.

    lm-eval-rolling   lm-evaluation-harness loglikelihood_rolling: documents apart, chunked windows from BOS
    hf-guide          the Hugging Face guide: rows joined by "\\n\\n", tokenized as tokenizer(text) does, sliding
    gptq              GPTQ's datautils + eval loop: rows joined, tokenized as tokenizer(text) does, disjoint
                      blocks of ctx, the tail dropped, each block's first token unscored
    llama.cpp         llama-perplexity: one text less one final newline (as -f reads it), tokenized with the default
                      BOS and special tokens' spellings as text, blocks of n_ctx whose first token becomes BOS, only
                      positions from n_ctx/2 scored, at least 2 blocks
    lm-eval-wikitext  lm-eval's wikitext task: its detokenizer on each page, rolling windows, words and bytes
                      counted on the original page
"""
from __future__ import annotations

import dataclasses
import gzip
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..config import CORPUS_PROTOCOLS, PROTOCOL_TEXT_FIELDS, PROTOCOL_WINDOWS
from ..errors import FastpplError
from .corpus import (HF_PREFIX, Document, Fields, decode_utf8, jsonl_documents, load_documents, parse_hf_source,
                     read_bytes)
from .hf_datasets import hf_rows


@dataclass(frozen=True)
class Protocol:
    name: str
    reference: str                    # the code whose loop it reproduces
    join: Optional[str] = None        # the documents become one text, joined by this; None: scored apart
    one_text: bool = False            # the corpus must be one text (llama-perplexity -f FILE)
    tokenizer_bos: bool = False       # a text starts with what the tokenizer adds by default (Llama: BOS; GPT-2: none)
    bos_each_block: bool = False      # blocks: each block's first token replaced by that BOS
    score_second_half: bool = False   # blocks: only window positions from ctx // 2 on are scored
    min_blocks: int = 1               # blocks: a text of fewer than min_blocks * ctx tokens is refused
    max_blocks: Optional[int] = None  # blocks: at most this many (set by a named corpus)
    detokenize: bool = False          # lm-eval's wikitext detokenizer on the scored text
    drop_final_newline: bool = False  # one "\n" at the text's end dropped (llama.cpp's -f FILE)
    specials_as_text: bool = False    # "<|endoftext|>" in the text is text, not the special token (llama.cpp
                                      # tokenizes without parse_special; a user-defined token is still matched)

    @property
    def window(self) -> str:
        """chunked | sliding | blocks (fastppl.data.windows): the one table of them is config.PROTOCOL_WINDOWS."""
        return PROTOCOL_WINDOWS[self.name]

    @property
    def text_field(self) -> str:
        """The default --text-field (config.PROTOCOL_TEXT_FIELDS)."""
        return PROTOCOL_TEXT_FIELDS.get(self.name, "text")


PROTOCOLS = {p.name: p for p in (
    Protocol("lm-eval-rolling", "lm-evaluation-harness loglikelihood_rolling"),
    Protocol("hf-guide", "Hugging Face guide 'Perplexity of fixed-length models'", join="\n\n",
             tokenizer_bos=True),
    Protocol("gptq", "IST-DASLab/gptq datautils.py and the eval loop of llama.py/opt.py", join="\n\n",
             tokenizer_bos=True),
    Protocol("llama.cpp", "llama.cpp tools/perplexity/perplexity.cpp perplexity()", one_text=True,
             tokenizer_bos=True, bos_each_block=True, score_second_half=True, min_blocks=2, drop_final_newline=True,
             specials_as_text=True),
    Protocol("lm-eval-wikitext", "lm-evaluation-harness lm_eval/tasks/wikitext", detokenize=True),
)}


@dataclass(frozen=True)
class NamedCorpus:
    """A corpus as the quantization literature reads it: a dataset split through `datasets`, or a local copy
    of its file in --data-dir / FASTPPL_DATA_DIR."""
    dataset: str
    config: Optional[str]
    split: str
    data_files: Optional[dict]
    local_files: tuple[str, ...]      # the dataset's own file names, looked for in the data directory
    join: str                         # rows joined by this
    protocols: tuple[str, ...]        # the protocols that read it (config.CORPUS_PROTOCOLS)
    max_rows: Optional[int] = None    # the first rows only
    max_blocks: Optional[int] = None  # the first max_blocks * ctx tokens only


CORPORA = {
    # datautils.get_wikitext2's test text
    "wikitext2": NamedCorpus("wikitext", "wikitext-2-raw-v1", "test", None, ("wiki.test.raw",), "\n\n",
                             CORPUS_PROTOCOLS["wikitext2"]),
    # datautils.get_c4_new's validation text: the first 1,100 documents of the first shard, the first 256 blocks
    "c4": NamedCorpus("allenai/c4", None, "validation", {"validation": "en/c4-validation.00000-of-00008.json.gz"},
                      ("c4-validation.00000-of-00008.json.gz", "c4-validation.00000-of-00008.json"), " ",
                      CORPUS_PROTOCOLS["c4"], max_rows=1100, max_blocks=256),
}


def wikitext_raw_rows(text: str) -> list[str]:
    """The rows `datasets` makes of a wikitext .raw file: each line with its newline, a blank line as ""."""
    return [line if line.strip() else "" for line in io.StringIO(text, newline=None)]


def _local_copy(corpus: NamedCorpus, data_dir: Optional[str]) -> Optional[Path]:
    directories = [d for d in (data_dir, os.environ.get("FASTPPL_DATA_DIR")) if d]
    for directory in directories:
        for name in corpus.local_files:
            if (Path(directory) / name).is_file():
                return Path(directory) / name
    if directories:
        raise FastpplError(f"no {' or '.join(corpus.local_files)} in {', '.join(directories)}; put the file there, "
                           "or drop --data-dir and FASTPPL_DATA_DIR to read it through `datasets`")
    return None


def read_named_corpus(name: str, data_dir: Optional[str], errors: str) -> tuple[list[str], dict]:
    """(the corpus' rows, where they came from: the dataset id, config, split, files and revision)."""
    corpus = CORPORA[name]
    record = {"id": corpus.dataset, "config": corpus.config, "split": corpus.split, "data_files": corpus.data_files}
    path = _local_copy(corpus, data_dir)
    if path is None:
        rows, revision = hf_rows(f"--data {name}", corpus.dataset, corpus.config, corpus.split, "text",
                                 corpus.data_files)
        rows = rows[:corpus.max_rows]
        return rows, {**record, "revision": revision, "read_from": "datasets", "rows": len(rows)}
    compressed = path.suffix == ".gz"
    raw = read_bytes(path, text=not compressed)
    if compressed:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError):   # not gzip, or cut short
            raise FastpplError(f"{path}: is not a whole gzip file; download it again") from None
        if b"\0" in raw:
            raise FastpplError(f"{path}: holds a NUL byte once decompressed, so it is not the corpus' text; "
                               "download it again")
    text = decode_utf8(raw, str(path), errors)
    if path.suffix == ".raw":
        rows = wikitext_raw_rows(text)
    else:
        rows = [d.text for d in jsonl_documents(text, path, Fields("text"))]
    rows = rows[:corpus.max_rows]   # the first rows (c4: 1,100 documents)
    return rows, {**record, "revision": None, "read_from": str(path), "rows": len(rows)}


def read_protocol_corpus(protocol: Protocol, sources: list[str], split: str, text_field: str,
                         data_dir: Optional[str], errors: str) -> tuple[list[Document], Protocol, list[dict]]:
    """The documents a protocol scores, the protocol with its corpus' rules, and the datasets read."""
    named = [s for s in sources if s in CORPORA]   # alone, of this protocol: EvalConfig checked it
    if named:
        rows, record = read_named_corpus(named[0], data_dir, errors)
        corpus = CORPORA[named[0]]
        protocol = dataclasses.replace(protocol, join=corpus.join, max_blocks=corpus.max_blocks)
        documents, datasets = [Document(id=f"{named[0]}:{i}", text=t) for i, t in enumerate(rows)], [record]
    else:
        documents, datasets = [], []
        for source in sources:
            if source.startswith(HF_PREFIX):
                documents += _hf_documents(source, text_field, datasets)
            else:
                documents += load_documents(source, split, text_field, data_dir, errors)
    return shape_documents(protocol, documents, ", ".join(sources)), protocol, datasets


def _hf_documents(source: str, text_field: str, datasets: list[dict]) -> list[Document]:
    name, config, split = parse_hf_source(source)
    texts, revision = hf_rows(f"--data {source}", name, config, split, text_field)
    datasets.append({"id": name, "config": config, "split": split, "data_files": None, "revision": revision,
                     "read_from": "datasets", "rows": len(texts)})
    return [Document(id=f"{source}:{row}", text=text) for row, text in enumerate(texts)]


def shape_documents(protocol: Protocol, documents: list[Document], source: str) -> list[Document]:
    """The documents as the protocol scores them: joined into one text, checked to be one, or detokenized."""
    if protocol.name != "lm-eval-rolling" and any(d.token_ids is not None for d in documents):
        raise FastpplError(f"--protocol {protocol.name} prepares a text, and a .npy corpus holds token ids; "
                           "pass the text, or use --protocol lm-eval-rolling")
    if protocol.join is not None:
        return [Document(id=source, text=protocol.join.join(d.text for d in documents))]
    if protocol.one_text and len(documents) != 1:
        raise FastpplError(f"--protocol {protocol.name} scores one text (llama-perplexity -f FILE), and --data holds "
                           f"{len(documents)} documents; pass one text file, such as wiki.test.raw")
    if protocol.detokenize:
        return [dataclasses.replace(d, text=wikitext_detokenize(d.text), counted_text=d.text) for d in documents]
    if protocol.drop_final_newline:
        return [dataclasses.replace(d, text=d.text[:-1]) if d.text.endswith("\n") else d for d in documents]
    return documents


# lm-evaluation-harness's wikitext detokenizer, as ordered rewrites: ("str", old, new) replaces a string,
# ("re", pattern, replacement) a regular expression
WIKITEXT_REWRITES = (
    ("str", "s '", "s'"), ("re", r"/' [0-9]/", r"/'[0-9]/"),                           # contractions
    ("str", " @-@ ", "-"), ("str", " @,@ ", ","), ("str", " @.@ ", "."),                # number separators
    *(("str", f" {mark} ", f"{mark} ") for mark in ":;.!?,"),                         # punctuation
    ("re", r"\(\s*([^\)]*?)\s*\)", r"(\1)"), ("re", r"\[\s*([^\]]*?)\s*\]", r"[\1]"),  # brackets and quotes
    ("re", r"{\s*([^}]*?)\s*}", r"{\1}"), ("re", r"\"\s*([^\"]*?)\s*\"", r'"\1"'),
    ("re", r"'\s*([^']*?)\s*'", r"'\1'"),
    ("str", "= = = =", "===="), ("str", "= = =", "==="), ("str", "= =", "=="),         # headings
    ("str", " \u00b0 ", "\u00b0"), ("str", " \n", "\n"), ("str", "\n ", "\n"),
    ("str", " N ", " 1 "), ("str", " 's", "'s"),
)


def wikitext_detokenize(text: str) -> str:
    for kind, old, new in WIKITEXT_REWRITES:
        text = text.replace(old, new) if kind == "str" else re.sub(old, new, text)
    return text
