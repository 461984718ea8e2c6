"""Per-group results (`--group-by FIELD`): each group's float64 sums from the per-document sums, divided once,
and two averages over the groups: micro (every token weighs the same: the whole corpus' figures) and macro (every
group weighs the same: the mean of the groups' figures, as Paloma averages over its domains)."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..data.corpus import Document
from ..data.streams import WindowPlan
from .metrics import perplexity


def group_metrics(name: str, documents: int, tokens: int, nll_sum: float, n_bytes: int) -> dict:
    nll = nll_sum / tokens
    return {"group": name, "documents": documents, "tokens": tokens, "nll_sum": nll_sum, "nll": nll,
            "ppl": perplexity(nll), "bytes": n_bytes,
            "bits_per_byte": nll_sum / math.log(2) / n_bytes if n_bytes else math.nan}


def group_results(field: str, documents: list[Document], plan: WindowPlan, nll_by_document: np.ndarray,
                  bytes_by_document: np.ndarray) -> Optional[dict]:
    """The report's "groups": {"field", "groups": [per group, by name], "micro", "macro"}; groups with no
    scored token are left out (they have no NLL)."""
    scored = plan.scored_documents
    names = sorted({documents[d].group for d in scored})
    code = {name: i for i, name in enumerate(names)}
    codes = np.array([code[documents[d].group] for d in scored], dtype=np.int64)
    def by_group(values: np.ndarray) -> np.ndarray:
        return np.bincount(codes, weights=values[scored], minlength=len(names))
    counts, tokens = np.bincount(codes, minlength=len(names)), by_group(plan.scored_by_document)
    nll_sums, n_bytes = by_group(nll_by_document), by_group(bytes_by_document)
    rows = [group_metrics(name, int(counts[i]), int(tokens[i]), float(nll_sums[i]), int(n_bytes[i]))
            for i, name in enumerate(names)]
    micro = group_metrics("micro", len(scored), sum(r["tokens"] for r in rows), math.fsum(r["nll_sum"] for r in rows),
                          sum(r["bytes"] for r in rows))
    macro = {"group": "macro", "documents": micro["documents"], "tokens": micro["tokens"],
             **{key: float(np.mean([r[key] for r in rows])) for key in ("nll", "ppl", "bits_per_byte")}}
    return {"field": field, "groups": rows, "micro": micro, "macro": macro}
