"""Hub downloads fetch one weight format (safetensors when the repo has them, following the index, else .bin), the
config and the tokenizer files, and nothing else; huggingface_hub is replaced by a stand-in that serves a listing."""
import json
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub.utils import filter_repo_objects

from fastppl.data.tokenize import TOKENIZER_FILES
from fastppl.errors import FastpplError
from fastppl.models.hub import HUB_CONFIG_FILES, hub_weight_files
from fastppl.models.loading import resolve_checkpoint_dir

TOKENIZER_AND_CONFIG = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                        "special_tokens_map.json", "vocab.json", "merges.txt"]
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
REPOS = {   # name: (files in the repo, what must be downloaded)
    "gpt2-like": (TOKENIZER_AND_CONFIG + ["model.safetensors", "pytorch_model.bin", "tf_model.h5", "flax_model.msgpack",
                                          "64-8bits.tflite", "onnx/decoder_model.onnx", "onnx/config.json",
                                          "README.md", ".gitattributes"],
                  TOKENIZER_AND_CONFIG + ["model.safetensors"]),
    "sharded, both formats": (
        TOKENIZER_AND_CONFIG + SHARDS + ["model.safetensors.index.json", "pytorch_model-00001-of-00002.bin",
                                         "pytorch_model-00002-of-00002.bin", "pytorch_model.bin.index.json",
                                         "original/consolidated.00.pth", "original/tokenizer.model",
                                         "model-00003-of-00003.safetensors"],   # in no index: not read
        TOKENIZER_AND_CONFIG + SHARDS + ["model.safetensors.index.json", "original/tokenizer.model"]),
    "bin only": (TOKENIZER_AND_CONFIG + ["pytorch_model.bin", "training_args.bin", "tf_model.h5"],
                 TOKENIZER_AND_CONFIG + ["pytorch_model.bin"]),
    "sharded bin only": (TOKENIZER_AND_CONFIG + ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
                                                 "pytorch_model.bin.index.json", "optimizer.pt"],
                         TOKENIZER_AND_CONFIG + ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
                                                 "pytorch_model.bin.index.json"]),
}
INDEXES = {"model.safetensors.index.json": {"weight_map": {"a": SHARDS[0], "b": SHARDS[1], "c": SHARDS[1]}},
           "pytorch_model.bin.index.json": {"weight_map": {"a": "pytorch_model-00001-of-00002.bin",
                                                           "b": "pytorch_model-00002-of-00002.bin"}}}


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """A stand-in hub holding one repo: its listing, its index files, and a snapshot_download that makes the files
    its allow_patterns select (as huggingface_hub filters them) and records them."""
    state = {"downloaded": None, "files": []}

    def model_info(repo_id, **kwargs):
        return SimpleNamespace(siblings=[SimpleNamespace(rfilename=name) for name in state["files"]])

    def hf_hub_download(repo_id, filename, **kwargs):
        path = tmp_path / "index" / filename
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(INDEXES[filename]))
        return str(path)

    def snapshot_download(repo_id, allow_patterns=None, **kwargs):
        chosen = sorted(filter_repo_objects(state["files"], allow_patterns=allow_patterns))
        state["downloaded"] = chosen
        snapshot = tmp_path / "snapshot"
        for name in chosen:
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            (snapshot / name).write_text("{}")
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "model_info", model_info)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return state


@pytest.mark.parametrize("repo", REPOS)
def test_one_weight_format_and_the_tokenizer_are_downloaded(fake_hub, repo):
    files, expected = REPOS[repo]
    fake_hub["files"] = files
    assert resolve_checkpoint_dir("org/model").name == "snapshot"
    assert fake_hub["downloaded"] == sorted(expected)


def test_offline_the_cached_snapshot_serves(fake_hub, monkeypatch):
    """Without a listing (offline), the download is asked for every format: the cache answers with what it holds."""
    def offline(repo_id, **kwargs):
        raise huggingface_hub.errors.OfflineModeIsEnabled("offline")
    monkeypatch.setattr(huggingface_hub, "model_info", offline)
    fake_hub["files"] = ["config.json", "model.safetensors"]
    resolve_checkpoint_dir("org/model")
    assert fake_hub["downloaded"] == ["config.json", "model.safetensors"]


def test_an_unknown_repo_is_one_line(fake_hub, monkeypatch):
    def missing(repo_id, **kwargs):
        raise OSError("404 Client Error: Repository Not Found")
    monkeypatch.setattr(huggingface_hub, "model_info", missing)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", missing)
    with pytest.raises(FastpplError, match="unknown model 'org/nothing'.*Repository Not Found.*--model PATH"):
        resolve_checkpoint_dir("org/nothing")


def test_weight_files_follow_the_index_only():
    read = INDEXES.__getitem__
    assert hub_weight_files(["model.safetensors.index.json", *SHARDS, "model.safetensors"], read) == \
        ["model.safetensors.index.json", *SHARDS]
    assert hub_weight_files(["consolidated.safetensors"], read) == ["consolidated.safetensors"]
    assert hub_weight_files(["sub/model.safetensors", "pytorch_model.bin"], read) == ["pytorch_model.bin"]
    assert hub_weight_files(["config.json"], read) == []


def test_every_tokenizer_file_is_downloaded_with_a_checkpoint():
    assert set(TOKENIZER_FILES) <= set(HUB_CONFIG_FILES)


def test_a_hub_model_brings_every_file_the_tokenizer_loader_reads():
    from fastppl.data.tokenize import TOKENIZER_FILES
    from fastppl.models.hub import HUB_CONFIG_FILES
    assert set(TOKENIZER_FILES) <= set(HUB_CONFIG_FILES)
