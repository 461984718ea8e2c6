"""JSON lines, as fastppl reads them: corpora (.jsonl) and --per-doc files; and JSON documents (reports) read
with the same care: valid JSON that Python's parser refuses is an error naming where it is, not a traceback."""
from __future__ import annotations

import json
import re
import sys
from typing import Iterator

from ..errors import FastpplError, first_line

# the tokens that locate what Python refuses: strings (skipped whole, so that digits or brackets inside them do
# not count), brackets, and integers (digits not followed by a fraction or exponent)
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]|-?\d+(?![\d.eE])')
# nesting past this depth is reported where it begins; Python's parser refuses it somewhere deeper
REPORTED_DEPTH = 500


class BeyondPythonsParser(json.JSONDecodeError):
    """Valid JSON that Python's parser does not read: an integer of too many digits, or nesting too deep."""


def describe(error: json.JSONDecodeError) -> str:
    """What is wrong, for a one-line error: "not valid JSON (reason)", or what Python does not read."""
    return error.msg if isinstance(error, BeyondPythonsParser) else f"not valid JSON ({error.msg})"


def _first_long_integer(text: str) -> int:
    limit = sys.get_int_max_str_digits()
    for token in _TOKENS.finditer(text):
        if token.group()[0] not in '"[]{}' and len(token.group().lstrip("-")) > limit:
            return token.start()
    return 0


def _first_deep(text: str) -> int:
    depth = 0
    for token in _TOKENS.finditer(text):
        depth += (token.group() in "[{") - (token.group() in "]}")   # a string or integer is neither
        if depth > REPORTED_DEPTH:
            return token.start()
    return 0


def loads(text: str) -> object:
    """json.loads, raising JSONDecodeError also where Python refuses valid JSON (a ValueError or RecursionError
    from json.loads), at the position concerned."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise BeyondPythonsParser(f"JSON nested more than {REPORTED_DEPTH} levels deep, deeper than Python reads",
                                  text, _first_deep(text)) from None
    except ValueError as e:   # Python converts integers of at most sys.get_int_max_str_digits() digits
        digits = "digits" in str(e)
        reason = (f"an integer of more than {sys.get_int_max_str_digits():,} digits, more than Python reads"
                  if digits else first_line(e))
        raise BeyondPythonsParser(reason, text, _first_long_integer(text) if digits else 0) from None


def json_lines(text: str, path, fix: str) -> Iterator[tuple[int, object]]:
    """(line number, value) of each non-blank line. Split on \\n only: str.splitlines() also splits on U+2028,
    U+0085, ... that JSON strings may hold raw. A line that is not JSON (or not JSON that Python reads) is a
    FastpplError naming path:line and `fix`, what the user should do."""
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield number, loads(line)
        except json.JSONDecodeError as e:
            raise FastpplError(f"{path}:{number}: {describe(e)}; {fix}") from None
