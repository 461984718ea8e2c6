"""A divergence run, `fastppl eval --model B --reference-model A`: the reference model A loaded beside B and
checked against it, and the divergence of B from A added to the report. Both models read the same windows of
the same tokens in one pass; fastppl.engine.divergence computes each token's values from their hidden states,
fastppl.report.divergence the statistics."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn

from .config import EvalConfig, gguf_spec
from .engine.divergence import COLUMNS, KLD_COLUMN
from .engine.precision import resolve_device
from .engine.score import DeviceSums
from .data.tokenize import Tokenizer, load_tokenizer, same_tokenizer
from .errors import FastpplError
from .models import load_model
from .models.loading import position_limit_note
from .report.divergence import divergence_statistics, kld_by_position, kld_histogram

if TYPE_CHECKING:
    from .data.corpus import Document
    from .data.streams import WindowPlan
    from .report.result import EvalResult


def resolve_reference_device(config: EvalConfig, device: torch.device) -> torch.device:
    """Where the reference model runs: --reference-device, else the run's device; resolved (and a bad one refused)
    before anything is read or loaded."""
    if config.reference_device is None:
        return device
    try:
        return resolve_device(config.reference_device)
    except FastpplError as error:   # its message names --device
        raise FastpplError(str(error).replace("--device", "--reference-device")) from None


# files whose presence makes a directory a tokenizer's (a checkpoint of weights alone holds none)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def reference_tokenizer(reference_model: str) -> Optional[Tokenizer]:
    """The reference model's own tokenizer: from its directory, its GGUF file's metadata, or the hub for a hub id.
    None where it has none (random weights, a directory of weights alone, a hub id whose repository serves no
    tokenizer)."""
    if reference_model.startswith("random:"):
        return None
    if gguf_spec(reference_model):
        return load_tokenizer(reference_model)
    path = Path(reference_model).expanduser()
    if path.exists():
        if not path.is_dir() or not any((path / name).is_file() for name in TOKENIZER_FILES):
            return None
        return load_tokenizer(str(path))
    try:
        return load_tokenizer(reference_model)
    except FastpplError:   # the weights came from the hub; a repository of weights alone has no tokenizer
        return None


def check_reference_tokenizer(config: EvalConfig, tokenizer: Tokenizer, own: Optional[Tokenizer]) -> None:
    """Both models must read the same ids as the same text: a reference whose own tokenizer (`own`, from
    reference_tokenizer; None where it has none) differs from the run's in any token or rule (the same vocabulary
    size is not enough) is refused."""
    if own is not None and not same_tokenizer(own, tokenizer):
        raise FastpplError(
            f"--reference-model {config.reference_model} has a tokenizer of its own that differs from the run's "
            f"({tokenizer.name}): the same ids would stand for other text; compare two models of one tokenizer")


def load_reference(config: EvalConfig, dtype: torch.dtype, device: torch.device, streamed: bool = False) -> nn.Module:
    """The --reference-model on its device (--reference-device, else the run's), in the model's dtype, or placed
    for the streamed path as the model is (fastppl.models.load_model); unchecked (check_reference_matches checks
    it against each model it is a reference of)."""
    seed = config.seed if config.reference_seed is None else config.reference_seed
    reference = load_model(config.reference_model, config.backend, dtype, seed, device, streamed)
    return reference if streamed else reference.to(device)


def check_reference_matches(config: EvalConfig, reference: nn.Module, model: nn.Module,
                            tokenizer: Optional[Tokenizer], own_tokenizer: Optional[Tokenizer]) -> None:
    """Refused when the reference's vocabulary is not the model's (the two must score the same token ids), or its
    own tokenizer is not the run's `tokenizer`."""
    if reference.vocab_size != model.vocab_size:
        raise FastpplError(
            f"--reference-model {config.reference_model} has a vocabulary of {reference.vocab_size:,} ids but "
            f"--model {config.model} has {model.vocab_size:,}; compare two models of one tokenizer and vocabulary")
    if tokenizer is not None:
        check_reference_tokenizer(config, tokenizer, own_tokenizer)


def check_reference_fits(config: EvalConfig, reference: Optional[nn.Module], ctx: int) -> None:
    if reference is not None and ctx > reference.max_positions:
        raise FastpplError(f"--ctx {ctx} exceeds the reference model's maximum of {reference.max_positions} "
                           f"positions{position_limit_note(reference)}; lower --ctx")


def add_divergence(result: EvalResult, config: EvalConfig, sums: DeviceSums, documents: Sequence[Document],
                   tokens: Sequence[np.ndarray], plan: WindowPlan) -> EvalResult:
    """The report's "divergence" section (and --per-token's columns) from the merged per-token values: the
    statistics over the corpus, and with --group-by over each group's documents too."""
    columns = sums.divergence[:-1].cpu().numpy()                       # (n_tokens, len(COLUMNS)), NaN rows unscored
    scored = ~np.isnan(columns[:, 0])
    counts = sums.position_count.cpu().numpy()
    result.divergence = {
        "reference_model": config.reference_model,
        "reference_seed": config.seed if config.reference_seed is None else config.reference_seed,
        **divergence_statistics(columns[scored]),
        # the model's figures as the run's own (its float64 device sums), not re-derived from fp32 per-token values
        "nll": result.metrics.nll, "ppl": result.metrics.ppl,
        "kld_by_position": kld_by_position(sums.position_kld_sum.cpu().numpy(), counts),
        "kld_histogram": kld_histogram(columns[scored][:, KLD_COLUMN].astype(np.float64)),
        "per_token_columns": list(COLUMNS),
    }
    if config.group_by:
        result.divergence["groups"] = divergence_by_group(columns, scored, documents, tokens, plan)
    if config.per_token:
        result.per_token = columns
    return result


def divergence_by_group(columns: np.ndarray, scored: np.ndarray, documents: Sequence[Document],
                        tokens: Sequence[np.ndarray], plan: WindowPlan) -> dict[str, dict]:
    """{group: the statistics over its documents' scored tokens}, by group name; groups with none left out."""
    group_of_token = np.full(len(columns), -1, dtype=np.int64)
    names = sorted({documents[d].group for d in plan.scored_documents})
    code = {name: i for i, name in enumerate(names)}
    for d in plan.scored_documents:
        offset = plan.streams[d].token_offset
        group_of_token[offset:offset + len(tokens[d])] = code[documents[d].group]
    return {name: divergence_statistics(columns[scored & (group_of_token == i)]) for name, i in code.items()
            if (scored & (group_of_token == i)).any()}
