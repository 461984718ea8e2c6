"""Plain-text and Markdown tables, for `fastppl compare`."""
from __future__ import annotations

from typing import Sequence


def one_line(text: str) -> str:
    """text with its line breaks written as \\n and \\r, so that a name holding one stays in its row."""
    return str(text).replace("\r", "\\r").replace("\n", "\\n")


def _markdown_cell(text: str) -> str:
    """A backslash and a pipe escaped (a bare pipe would end the cell), and line breaks written out."""
    return one_line(text.replace("\\", "\\\\").replace("|", "\\|"))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool,
                 right: Sequence[bool]) -> str:
    if markdown:
        rule = ["---:" if r else "---" for r in right]
        lines = [headers, rule, *rows]
        return "\n".join("| " + " | ".join(_markdown_cell(cell) for cell in line) + " |" for line in lines)
    rows = [[one_line(cell) for cell in row] for row in rows]
    widths = [max(len(line[i]) for line in (headers, *rows)) for i in range(len(headers))]
    def line(cells):
        return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])
