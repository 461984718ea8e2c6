"""Plain-text and Markdown tables, for `fastppl compare`."""
from __future__ import annotations

from typing import Sequence


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool,
                 right: Sequence[bool]) -> str:
    if markdown:
        rule = ["---:" if r else "---" for r in right]
        lines = [headers, rule, *rows]
        return "\n".join("| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |" for line in lines)
    widths = [max(len(line[i]) for line in (headers, *rows)) for i in range(len(headers))]
    def line(cells):
        return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])
