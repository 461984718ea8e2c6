"""`fastppl compare` across runs of one text: which columns compare (per-token figures only over the same tokens),
and the paired differences of runs made with `eval --bootstrap` (fastppl.report.stats)."""
from __future__ import annotations

from typing import Optional, Sequence

from ..errors import FastpplError
from .stats import Units, bits_per_byte, check_bootstrap_work, nll_per_token, paired_difference
from .tables import format_table


def same_text(a: dict, b: dict) -> bool:
    """Both reports carry corpus_sha256 and it is the same: the runs read the same text."""
    return a.get("corpus_sha256") is not None and a.get("corpus_sha256") == b.get("corpus_sha256")


def per_token_comparable(a: dict, b: dict) -> bool:
    """NLL and perplexity average over tokens: they compare only where the runs scored as many of them. Runs
    of one text with other tokenizers compare by bits per byte."""
    return a["tokens_scored"] == b["tokens_scored"]


def plus_minus(stderr) -> str:
    return "" if stderr is None else f" ± {stderr:.6f}"


def resampled_units(run) -> Optional[Units]:
    """The units a run's bootstrap resampled (None without --bootstrap), checked as far as compare reads them."""
    boot = run.result.get("bootstrap")
    if boot is None:
        return None
    try:
        units = Units.from_dict(boot["resampled"])
        lengths = {len(units.index), len(units.nll_sum), len(units.tokens), len(units.bytes)}
        settings_ok = all(isinstance(boot[k], int) and not isinstance(boot[k], bool) and boot[k] >= 0
                          for k in ("replicates", "seed")) and isinstance(boot["level"], float)
    except (KeyError, TypeError, ValueError):
        lengths, settings_ok = set(), False
    if len(lengths) != 1 or not settings_ok or not (units.tokens > 0).all():
        raise FastpplError(f"{run.path}: its 'bootstrap' field is not one fastppl eval --bootstrap writes; pass the "
                           "report as eval wrote it")
    return units


def paired_table(runs: Sequence, markdown: bool = False) -> Optional[str]:
    """Each run's paired difference against the first, over the units both bootstraps resampled (documents,
    or one document's windows): ΔNLL where the runs scored the same tokens, else Δbits/byte (same text)."""
    first = runs[0]
    base = resampled_units(first)
    if len(runs) < 2 or base is None:
        return None
    boot = first.result["bootstrap"]
    check_bootstrap_work(boot["replicates"], len(base.index), base.kind, f"{first.path}: its bootstrap of")
    rows = []
    for run in runs[1:]:
        other = resampled_units(run)
        same_tokens = per_token_comparable(first.result, run.result)
        measure = "ΔNLL" if same_tokens else "Δbits/byte"
        paired = None
        if other is not None and same_text(first.result, run.result):
            paired = paired_difference(base, other, nll_per_token if same_tokens else bits_per_byte,
                                       boot["replicates"], boot["seed"])
        if paired is None:
            rows.append([run.label, measure, "n/a", "n/a", "no units to pair (eval --bootstrap N on the same text; "
                                                           "windows pair only with the same tokens)"])
            continue
        rows.append([run.label, measure, f"{paired['difference']:+.6f}",
                     f"[{paired['interval'][0]:+.6f}, {paired['interval'][1]:+.6f}]",
                     f"{paired['lower_share']:.1%} of {paired['replicates']:,} resamples of {paired['units']:,} "
                     f"{paired['unit']}s"])
    return (f"paired differences against {first.label} ({boot['level']:.0%} bootstrap interval, seed {boot['seed']})\n"
            + format_table(["run", "measure", "Δ", "interval", f"lower than {first.label} in"], rows, markdown,
                           [False, False, True, True, False]))
