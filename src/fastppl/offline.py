"""Runs without a network: a download that cannot reach its server raises Unreachable, and evaluate() turns the
first into one line naming everything of the run that is not local (corpus, tokenizer, model), and how to supply
each, so that an offline run does not fail once for each of them."""
from __future__ import annotations

import functools
from pathlib import Path

from .config import cache_dir, data_directories, gguf_spec
from .errors import FastpplError, Unreachable


def _hub_cached(repo_id: str, filenames: tuple[str, ...]) -> bool:
    from huggingface_hub import try_to_load_from_cache
    try:
        return any(isinstance(try_to_load_from_cache(repo_id, name), str) for name in filenames)
    except Exception:   # not a valid repo id: not in the cache either
        return False


def _is_hub_id(spec: str) -> bool:
    return not Path(spec).expanduser().exists() and not spec.startswith("random:") and not gguf_spec(spec)


def not_local(config) -> list[str]:
    """What the run would download, each with how to give it locally instead."""
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
