"""Offline: a download that cannot reach its server says "unreachable" (not "unknown"), and a run that needs
several downloads names them all in one line, with how to give each locally."""
import socket
import urllib.error
import urllib.request

import pytest

from fastppl.cli import main
from fastppl.config import EvalConfig
from fastppl.errors import FastpplError
from fastppl.errors import is_unreachable
from fastppl.pipeline import evaluate


class ConnectError(Exception):   # httpx's name for it
    pass


class RepositoryNotFoundError(Exception):
    pass


@pytest.mark.parametrize("error, unreachable", [
    (socket.gaierror(-2, "Name or service not known"), True),
    (urllib.error.URLError(socket.gaierror(-2, "Name or service not known")), True),
    (ConnectError("[Errno -2] Name or service not known"), True),
    (ConnectionRefusedError(111, "Connection refused"), True),
    (RepositoryNotFoundError("404 Client Error. Repository Not Found"), False),
    (urllib.error.URLError("network disabled in tests"), False),
    (ValueError("bad"), False),
])
def test_unreachable_is_told_from_an_answer(error, unreachable):
    assert is_unreachable(error) == unreachable


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """Every download fails as it does with no route to the server; empty caches."""
    import huggingface_hub
    import huggingface_hub.constants

    def unreachable(*args, **kwargs):
        raise urllib.error.URLError(socket.gaierror(-2, "Name or service not known"))

    def hub_unreachable(*args, **kwargs):
        raise ConnectError("[Errno -2] Name or service not known")

    monkeypatch.setattr(urllib.request, "urlopen", unreachable)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub_unreachable)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("FASTPPL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FASTPPL_DATA_DIR", raising=False)


def test_the_main_job_offline_names_all_it_needs_in_one_line(no_network, capsys):
    assert main(["eval", "--model", "org/model", "--data", "tinyshakespeare", "--split", "val"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fastppl: error: the network is unreachable")
    for needed in ("the corpus tinyshakespeare (--data-dir DIR holding tinyshakespeare.txt, or --data PATH)",
                   "the tokenizer org/model (--tokenizer DIR)", "the model org/model (--model DIR"):
        assert needed in err, needed
    assert "unknown" not in err


def test_one_thing_not_local_is_named_with_the_hubs_reason(no_network, shakespeare):
    with pytest.raises(FastpplError, match=r"^tokenizer 'org/model': not a local directory, and the hub is "
                                           r"unreachable \(\[Errno -2\] Name or service not known\); pass --tokenizer"):
        evaluate(EvalConfig(model="random:gpt2-tiny", tokenizer="org/model", data=[str(shakespeare)],
                            device="cpu", quiet=True))


def test_a_random_preset_takes_the_data_directorys_tokenizer(no_network, tokenizer_dir, shakespeare, tmp_path):
    """--data-dir (or FASTPPL_DATA_DIR) holding gpt2-tokenizer/, as the shared data folder does: no --tokenizer,
    no hub."""
    text = tmp_path / "a.txt"
    text.write_text(shakespeare.read_text()[:400])
    local = dict(model="random:gpt2-tiny", data=[str(text)], device="cpu", quiet=True)
    with pytest.raises(FastpplError, match="tokenizer 'gpt2': not a local directory, and the hub is unreachable"):
        evaluate(EvalConfig(**local))
    result = evaluate(EvalConfig(**local, data_dir=str(tokenizer_dir.parent)))
    assert result["tokens_scored"] == 128


def test_a_named_corpus_without_its_protocol_says_where_its_file_goes(capsys):
    assert main(["eval", "--model", "random:gpt2-tiny", "--data", "wikitext2"]) == 2
    assert "add --protocol gptq (it reads its file from --data-dir DIR" in capsys.readouterr().err
