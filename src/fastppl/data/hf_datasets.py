"""Hugging Face datasets read through the `datasets` library (cached; offline it must already hold them)."""
from __future__ import annotations

import re
from typing import Optional

from ..errors import FastpplError, first_line


def dataset_revision(dataset) -> Optional[str]:
    """The hub commit a loaded dataset was read at, where `datasets` records it (its data files' hf://...@SHA
    paths, or its cache folder named by the commit), else None."""
    try:
        places = [*(dataset.info.download_checksums or {}), *(f["filename"] for f in dataset.cache_files)]
    except (AttributeError, KeyError, TypeError):
        return None
    for place in places:
        found = re.search(r"@([0-9a-f]{40})\b", place) or re.search(r"/([0-9a-f]{40})/", place)
        if found:
            return found.group(1)
    return None


def load_hf_dataset(label: str, name: str, config: Optional[str], split: str, data_files: Optional[dict] = None):
    """A Hugging Face dataset split through `datasets` (cached); label names the source in errors."""
    try:
        import datasets
    except ImportError:
        raise FastpplError(
            f"{label}: reading Hugging Face datasets needs the `datasets` package; "
            "pip install datasets, or export the split to a .jsonl file and pass that"
        ) from None
    try:
        return datasets.load_dataset(name, config, split=split, **({"data_files": data_files} if data_files else {}))
    except Exception as e:  # datasets raises many types for offline, unknown names, configs and splits
        raise FastpplError(
            f"{label}: cannot load dataset {name!r} (config {config}, split {split}): {first_line(e)}; "
            "offline, it must already be in the datasets cache (HF_DATASETS_OFFLINE=1)"
        ) from None


def check_texts(label: str, texts, text_field: str) -> None:
    for row, text in enumerate(texts):
        if not isinstance(text, str):
            raise FastpplError(f"{label}: row {row}: field {text_field!r} is not a string; pick the text field "
                               "with --text-field")
    if not texts:
        raise FastpplError(f"{label}: the split holds no rows")


def hf_rows(label: str, name: str, config: Optional[str], split: str, text_field: str,
            data_files: Optional[dict] = None) -> tuple[list[str], Optional[str]]:
    """The text field of every row of a Hugging Face dataset split, and the hub revision it was read at (None
    where unknown)."""
    dataset = load_hf_dataset(label, name, config, split, data_files)
    if text_field not in dataset.column_names:
        raise FastpplError(f"{label}: no field {text_field!r}; its fields are {', '.join(dataset.column_names)}; "
                           "pass --text-field NAME")
    texts = list(dataset[text_field])
    check_texts(label, texts, text_field)
    return texts, dataset_revision(dataset)
