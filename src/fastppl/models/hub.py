"""What to download of a hub model: one weight format (safetensors when the repo has them, following the index,
else pytorch_model*.bin), the config and the tokenizer files; nothing else (not a second format of the weights,
nor ONNX, TensorFlow, Flax or original/ copies)."""
from __future__ import annotations

import fnmatch
import glob
import json
from pathlib import Path

# besides the weights, what a checkpoint's run reads: its config and the files the tokenizer loader may read
# (fastppl.data.tokenize.TOKENIZER_FILES: models/ does not import data/, and a test holds the two together)
HUB_CONFIG_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "*.model",
                    "*.tiktoken"]
# offline, no listing: the cached snapshot serves whatever it holds
ANY_FORMAT = ["*.json", "*.safetensors", "*.bin", "*.txt", "*.model", "*.tiktoken"]


def hub_weight_files(repo_files: list[str], read_index) -> list[str]:
    """The weight files of one format, those fastppl.models.loading.checkpoint_index reads: safetensors when the
    repo has them, else pytorch_model*.bin; an index and its shards, else the single file, else every file of the
    pattern at the top level. read_index(name) -> the index's parsed JSON."""
    top = [name for name in repo_files if "/" not in name]
    for single, pattern in (("model.safetensors", "*.safetensors"), ("pytorch_model.bin", "pytorch_model*.bin")):
        index = single + ".index.json"
        if index in top:
            return [index, *sorted(set(read_index(index)["weight_map"].values()))]
        if single in top:
            return [single]
        matching = sorted(name for name in top if fnmatch.fnmatch(name, pattern))
        if matching:
            return matching
    return []


def hub_patterns(repo_id: str) -> list[str]:
    """What to download of a hub model: one weight format, the config and the tokenizer files."""
    from huggingface_hub import hf_hub_download, model_info
    try:
        # the model's file list in one request: list_repo_files retried a lost network for 23 s, 5 lines of warnings
        files = [sibling.rfilename for sibling in model_info(repo_id).siblings or []]
    except Exception:   # offline (the cache serves), or a bad id, which the download then names
        return ANY_FORMAT
    if not files:   # a listing without the files: the download is asked for every format
        return ANY_FORMAT
    weights = hub_weight_files(files, lambda name: json.loads(Path(hf_hub_download(repo_id, name)).read_text()))
    return HUB_CONFIG_FILES + [glob.escape(name) for name in weights]
