"""The human summary of a result, printed on stdout."""
from __future__ import annotations

import math

from .tables import format_table


def _figure(value, spec: str) -> str:
    """value by spec; n/a where it is unknown (NaN: no bytes, nothing timed), and in e-notation from 1e12 on, where
    a broken model's perplexity would otherwise print hundreds of digits."""
    if value is None or math.isnan(value):
        return "n/a"
    return format(value, ".4e") if math.isfinite(value) and abs(value) >= 1e12 else format(value, spec)


def _bytes(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def _word_and_byte_ppl(result: dict) -> str:
    byte_ppl = _figure(result["byte_perplexity"], ".6f")
    if result["window"] == "blocks":   # a protocol's blocks score part of the text, and words count all of it
        return f"byte ppl    {byte_ppl}"
    words, word_ppl = result["words"], _figure(result["word_perplexity"], ".4f")
    if word_ppl == "inf" and words:   # past the float range (a corpus of very few words): its exponent
        word_ppl = f"exp({result['nll_sum'] / words:,.1f})"
    return f"word ppl    {word_ppl}  ({words:,} word{'s' if words != 1 else ''})   byte ppl {byte_ppl}"


def summary(result: dict) -> str:
    cfg = result["config"]
    window = f"{result['window']} ctx={result['ctx']}" + (
        f" stride={result['stride']}" if result["stride"] else "")
    lines = [
        f"model       {cfg['model']}  ({result['dtype']}, {result['environment']['device_name']}"
        + (f"; {result['backend']}" if result.get("backend", "native") != "native" else "") + ")",
        f"data        {', '.join(cfg['data'])}  split={cfg['split']}  {result['documents']} document(s)"
        + (f" ({result['documents_skipped']} skipped: no token to score)" if result.get("documents_skipped") else ""),
        f"windows     {window}  {result['windows']:,} windows",
        f"batching    {result['batching']}"
        + (f" ({result['document_attention']} attention)" if result.get("document_attention") else "")
        + (f"  {result['batches']:,} batches  padding waste {result['padding_waste']:.1%} (padded tokens / real tokens)"
           if result.get("batches") is not None else "")
        + (f"  batch size {result['batch_size']}" + (f" ({result['batch_size_reason']})"
           if result.get("batch_size_reason") else "") if result.get("batch_size") else "")
        + (f"  resumed after batch {result['resumed_from_batch']:,}" if result.get("resumed_from_batch") else ""),
        f"tokens      {result['tokens_scored']:,} scored of {result['tokens_total']:,}  ({result['bytes']:,} bytes)",
        f"nll         {result['nll']:.6f}{_plus_minus(result.get('nll_stderr'), '.6f')} nats/token",
        f"perplexity  {_figure(result['ppl'], '.4f')}{_plus_minus(result.get('ppl_stderr'), '.4f')}",
        f"bits/byte   {_figure(result['bits_per_byte'], '.6f')}"
        f"{_plus_minus(result.get('bits_per_byte_stderr'), '.6f')}",
        _word_and_byte_ppl(result),
        f"speed       {_figure(result['tokens_per_second'], ',.0f')} tokens/s  ({result['wall_seconds']:.2f} s wall, "
        f"compile {result['compile']}, peak {_bytes(result['peak_memory_bytes'])})",
    ]
    if result.get("bootstrap"):
        lines.append(bootstrap_line(result["bootstrap"]))
    card = result.get("protocol") or {}
    if card.get("reported"):
        lines.append(f"protocol    {card['name']}: {card['reported']['line']}")
    if result.get("kv_cache", "").startswith("on"):
        run, without = result["tokens_forwarded"], result["tokens_forwarded_without_cache"]
        lines.append(f"kv cache    {result['kv_cache']}: {run:,} token positions run instead of {without:,} "
                     f"({without / max(run, 1):.1f}x fewer)")
    if result.get("streaming"):
        streaming = result["streaming"]
        waves = f"{streaming['waves']:,} wave" + ("s" if streaming["waves"] != 1 else "")
        lines.append(f"placement   streamed ({result['placement_reason']}): {waves}, "
                     f"{streaming['bytes_streamed'] / 1e9:.2f} GB into the block buffers in "
                     f"{streaming['copy_seconds']:.2f} s, {streaming['copy_seconds_hidden']:.2f} s of it behind "
                     f"compute; the blocks rest in {streaming['blocks_rest_in']}")
    if result.get("groups"):
        lines.append(groups_table(result["groups"]))
    if result.get("divergence"):
        from .divergence import divergence_lines
        lines += divergence_lines(result["divergence"])
    return "\n".join(lines)


def _plus_minus(value, spec: str) -> str:
    """" ± se" (the standard error), or nothing where it is unknown (a report of one token)."""
    return "" if value is None or math.isnan(value) else f" ± {_figure(value, spec)}"


def _interval(bounds, spec: str) -> str:
    return "n/a" if bounds is None else f"[{_figure(bounds[0], spec)}, {_figure(bounds[1], spec)}]"


def bootstrap_line(boot: dict) -> str:
    return (f"bootstrap   {boot['level']:.0%}: nll {_interval(boot['nll'], '.6f')}  ppl {_interval(boot['ppl'], '.4f')}"
            f"  bits/byte {_interval(boot['bits_per_byte'], '.6f')}  ({boot['replicates']:,} resamples of "
            f"{boot['units']:,} {boot['unit']}s, seed {boot['seed']})")


def groups_table(groups: dict) -> str:
    rows = [(g["group"], f"{g['documents']:,}", f"{g['tokens']:,}", f"{g['nll']:.6f}", _figure(g["ppl"], ".4f"),
             _figure(g["bits_per_byte"], ".6f")) for g in groups["groups"]]
    for average in ("micro", "macro"):
        g = groups[average]
        rows.append((f"({average} average)", f"{g['documents']:,}", f"{g['tokens']:,}", f"{g['nll']:.6f}",
                     _figure(g["ppl"], ".4f"), _figure(g["bits_per_byte"], ".6f")))
    headers = (f"by {groups['field']}", "documents", "tokens", "nll", "ppl", "bits/byte")
    return "\n" + format_table(headers, rows, markdown=False, right=[False] + [True] * (len(headers) - 1))
