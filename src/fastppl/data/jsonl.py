"""JSON lines, as fastppl reads them: corpora (.jsonl) and --per-doc files."""
from __future__ import annotations

import json
from typing import Iterator

from ..errors import FastpplError


def json_lines(text: str, path, fix: str) -> Iterator[tuple[int, object]]:
    """(line number, value) of each non-blank line. Split on \\n only: str.splitlines() also splits on U+2028,
    U+0085, ... that JSON strings may hold raw. A line that is not JSON is a FastpplError naming path:line and
    `fix`, what the user should do."""
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as e:
            raise FastpplError(f"{path}:{number}: not valid JSON ({e.msg}); {fix}") from None
