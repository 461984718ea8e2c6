"""What the subcommands share: the parser class, argument types and the help of --model and friends.

Nothing here imports torch: the CLI imports it late, once the arguments are known to be good."""
from __future__ import annotations

import argparse


# the random:PRESET shapes, as in the families' specs (fastppl.models.registry.presets(); those modules import torch,
# which the parser must not); tests/cli/test_help.py keeps the lists equal
GPT2_PRESETS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt2-tiny")
LLAMA_PRESETS = ("llama-1b", "llama-8b", "llama-tiny")
QWEN3_PRESETS = ("qwen3-tiny",)
RANDOM_PRESETS = GPT2_PRESETS + LLAMA_PRESETS + QWEN3_PRESETS

PRESETS_HELP = f"PRESET: {', '.join(RANDOM_PRESETS)}"
MODEL_HELP = ("a Hugging Face checkpoint directory (config.json + weights), a hub id, a FILE.gguf (or "
              "owner/repo:FILE.gguf), or random:PRESET for "
              f"seeded random weights of a built-in shape ({PRESETS_HELP}); required")
TOKENIZER_HELP = "tokenizer directory or hub id (default: the model's own; gpt2's for random:PRESET)"
DEVICE_HELP = "auto, cpu, cuda or cuda:N (default: %(default)s: CUDA if a GPU is visible, else cpu)"
DTYPE_HELP = "weights and activations (default: %(default)s: bf16 on CUDA, fp32 on cpu)"
FLAG_OFF = " (default: off)"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block), exit code 2 as for every other bad input."""

    def error(self, message: str):
        self.exit(2, f"fastppl: error: {message}; see {self.prog} --help\n")


def batch_size(value: str):
    """An argparse type: a positive integer (checked by the config) or auto."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {value!r}") from None


def memory_size_argument(value: str) -> int:
    """An argparse type: a size such as 8GiB (fastppl.config.memory_size)."""
    from ..config import memory_size
    from ..errors import FastpplError
    try:
        return memory_size(value, "--max-gpu-memory")
    except FastpplError:
        raise argparse.ArgumentTypeError(f"expected a size such as 8GiB, 500MiB or bytes, got {value!r}") from None


def at_least(minimum: int):
    """An argparse type: an integer of at least minimum."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {number}")
        return number
    return parse


def seed(value: str) -> int:
    """torch seeds with a 64-bit integer; a larger one fails deep inside torch."""
    number = at_least(-2**63)(value)
    if number >= 2**64:
        raise argparse.ArgumentTypeError(f"must be below 2**64, got {number}")
    return number


def check_model_given(spec: str, flag: str = "--model") -> None:
    """--model (or --reference-model) as given, checked before the tokenizer is loaded from its name, which would
    report a bad name obscurely."""
    from ..config import check_model_spec
    check_model_spec(spec, flag)
    from ..models.loading import check_random_preset, local_checkpoint_dir
    check_random_preset(spec)
    local_checkpoint_dir(spec, flag)
