"""Runs without a network: a download that cannot reach its server raises Unreachable, and evaluate() turns the
first into one line naming everything of the run that is not local (corpus, tokenizer, model), and how to supply
each, so that an offline run does not fail once for each of them."""
from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from typing import Optional

from .errors import FastpplError

# the hub's and the HTTP clients' names for "could not get there" (huggingface_hub, httpx, requests, urllib3)
_UNREACHABLE_NAMES = ("ConnectError", "ConnectionError", "ConnectTimeout", "Timeout", "OfflineModeIsEnabled",
                      "LocalEntryNotFoundError", "NameResolutionError", "MaxRetryError", "NetworkError")
LOCAL_GPT2_TOKENIZER = "gpt2-tokenizer"   # the GPT-2 tokenizer's folder in a data directory


class Unreachable(FastpplError):
    """A download whose server could not be reached (offline), as opposed to one that answered no."""


def is_unreachable(error: BaseException) -> bool:
    """Whether error, or an error it was raised from, says the network or the server could not be reached."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (socket.gaierror, socket.timeout, ConnectionError, TimeoutError)):
            return True
        if any(name in cls.__name__ for cls in type(error).__mro__ for name in _UNREACHABLE_NAMES):
            return True
        if isinstance(getattr(error, "reason", None), BaseException):   # urllib's URLError wraps the socket's
            error = error.reason
            continue
        error = error.__cause__ or error.__context__
    return False


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


def _hub_cached(repo_id: str, filenames: tuple[str, ...]) -> bool:
    from huggingface_hub import try_to_load_from_cache
    try:
        return any(isinstance(try_to_load_from_cache(repo_id, name), str) for name in filenames)
    except Exception:   # not a valid repo id: not in the cache either
        return False


def _is_hub_id(spec: str) -> bool:
    from .config import gguf_spec   # config imports this module's callers
    return not Path(spec).expanduser().exists() and not spec.startswith("random:") and not gguf_spec(spec)


def not_local(config) -> list[str]:
    """What the run would download, each with how to give it locally instead."""
    from .config import cache_dir
    from .data.corpus import BUILTINS
    from .data.tokenize import default_tokenizer_name
    missing = []
    for source in config.data:
        if source in BUILTINS and not Path(source).exists() and not data_directories(config.data_dir) and \
                not (cache_dir() / "data" / BUILTINS[source].filename).exists():
            missing.append(f"the corpus {source} (--data-dir DIR holding {BUILTINS[source].filename}, or --data PATH)")
    tokenizer = config.tokenizer or default_tokenizer_name(config.model, config.data_dir)
    if _is_hub_id(tokenizer) and not _hub_cached(tokenizer, ("tokenizer.json", "vocab.json", "tokenizer_config.json")):
        missing.append(f"the tokenizer {tokenizer} (--tokenizer DIR)")
    for flag, spec in (("--model", config.model), ("--reference-model", config.reference_model)):
        if spec and _is_hub_id(spec) and not _hub_cached(spec, ("config.json",)):
            missing.append(f"the model {spec} ({flag} DIR, a checkpoint directory; or random:PRESET)")
    return missing


def offline_message(config, error: Unreachable) -> str:
    missing = not_local(config)
    if len(missing) < 2:   # the error itself names the one thing, with the hub's reason
        return str(error)
    return (f"the network is unreachable, and this run needs {'; '.join(missing)}: give "
            f"{'it' if len(missing) == 1 else 'them'} as local paths (hub ids already in the Hugging Face cache "
            "are read from it)")


def explain_offline(evaluate):
    """evaluate(config, ...), with a first Unreachable download turned into one line of all that is not local."""
    @functools.wraps(evaluate)
    def wrapped(config, *args, **kwargs):
        try:
            return evaluate(config, *args, **kwargs)
        except Unreachable as error:
            raise FastpplError(offline_message(config, error)) from None
    return wrapped
