"""The human summary of a result, printed on stdout."""
from __future__ import annotations

import math


def _figure(value, spec: str) -> str:
    """value by spec; n/a where it is unknown (NaN: no bytes, nothing timed), and in e-notation from 1e12 on, where
    a broken model's perplexity would otherwise print hundreds of digits."""
    if value is None or math.isnan(value):
        return "n/a"
    return format(value, ".4e") if math.isfinite(value) and abs(value) >= 1e12 else format(value, spec)


def _bytes(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


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
        f"nll         {result['nll']:.6f} nats/token",
        f"perplexity  {_figure(result['ppl'], '.4f')}",
        f"bits/byte   {_figure(result['bits_per_byte'], '.6f')}",
        f"word ppl    {_figure(result['word_perplexity'], '.4f')}  ({result['words']:,} words)   "
        f"byte ppl {_figure(result['byte_perplexity'], '.6f')}",
        f"speed       {_figure(result['tokens_per_second'], ',.0f')} tokens/s  ({result['wall_seconds']:.2f} s wall, "
        f"compile {result['compile']}, peak {_bytes(result['peak_memory_bytes'])})",
    ]
    if result.get("kv_cache", "").startswith("on"):
        run, without = result["tokens_forwarded"], result["tokens_forwarded_without_cache"]
        lines.append(f"kv cache    {result['kv_cache']}: {run:,} token positions run instead of {without:,} "
                     f"({without / max(run, 1):.1f}x fewer)")
    if result.get("divergence"):
        from .divergence import divergence_lines
        lines += divergence_lines(result["divergence"])
    return "\n".join(lines)
