"""Where a long text may be cut so that its pieces, encoded apart, give the ids of one encode of the whole text
(fastppl.data.pieces encodes them in parallel). A cut is taken only where it is proven safe for the tokenizer
at hand; a tokenizer outside these rules has its texts encoded whole.

The rules. A tokenizer is cut only when each of its stages is one whose effect near a cut is known:

  normalizer      none, or per-character ones: NFC, NFD, NFKC, NFKD, Lowercase, StripAccents, BertNormalizer,
                  Replace of one non-ASCII character (not Strip, not Prepend: they act on a text's ends)
  pre-tokenizer   a first stage that splits: ByteLevel with its regex, Split on GPT-2's, Llama-3's, Qwen2's or
                  o200k's regex (isolated), Metaspace with split, Whitespace, WhitespaceSplit, BertPreTokenizer;
                  then any of those, ByteLevel without its regex, or Digits, each applied to every pre-token alone
  model           BPE without dropout, WordPiece, WordLevel, Unigram: each pre-token encoded alone
  post-processor  none or one that adds only special tokens, which an encode without them never asks for

and a cut at position q only where text[q - 1] is an ASCII letter or digit, text[q] == " " and text[q + 1] an
ASCII letter or digit, and no added token's content occurs (compared case-folded) within its longest content
plus MARGIN characters of q. Why the ids are then unchanged, stage by stage:

  added tokens    they split the text first (leftmost-longest matching); with no occurrence near q, the left
                  piece holds the same occurrences before q and the right piece those after, matched alike, and
                  lstrip / rstrip take in whitespace only up to a non-space character, never across q - 1 or q + 1
  normalizer      each listed one maps a character alone (NFC's compositions never join across a space, which
                  follows no character in a composition), and none changes an ASCII letter, digit or space but
                  to a letter, digit or space; with a normalizer and added tokens that match normalised text, the
                  window around q must be printable ASCII too, so that it is the same length normalised
  pre-tokenizer   before q stands a non-space character, at q a space. No alternative of the four regexes
                  matches a non-space character followed by a space, none looks behind, and a match ending before
                  q reads no character past its end but the one that stops it (a space, or the end of the left
                  piece: both stop it alike), so one scan of the whole text and the scans of the two pieces give
                  the same pre-tokens. Metaspace splits before every space; the Whitespace family and Bert drop
                  the space. The right piece then starts with its space, so that neither a ByteLevel prefix space
                  nor a Metaspace prepended "▁" is added to it; the left piece starts where the text does.

fastppl.data.pieces also encodes every chosen cut's neighbourhood both ways and keeps the cut only when the ids
agree: a guard, not the proof.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

MARGIN = 64   # characters beyond the longest added token that must hold none

# the regexes whose locality is argued above, exactly as tokenizer.json files hold them
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
O200K_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
                 r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
KNOWN_PATTERNS = (GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN, O200K_PATTERN)

PER_CHARACTER_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "StripAccents", "BertNormalizer"}
PROCESSORS_OF_SPECIALS = {"TemplateProcessing", "BertProcessing", "RobertaProcessing", "ByteLevel"}
MODELS = {"BPE", "WordPiece", "WordLevel", "Unigram"}
# a space between two ASCII letters or digits (the position of the space)
CUT_PATTERN = re.compile(r"(?<=[A-Za-z0-9]) (?=[A-Za-z0-9])")
NOT_PRINTABLE_ASCII = re.compile(r"[^\x20-\x7e\t\n\r]")
WHITESPACE_AS_SPACE = str.maketrans("\t\n\r", "   ")   # BertNormalizer maps these to spaces


def _state(component) -> Optional[dict]:
    return None if component is None else json.loads(component.__getstate__())


def _flat(state: dict, key: str) -> list[dict]:
    """A Sequence's members, nested ones included, in order."""
    if state.get("type") != "Sequence":
        return [state]
    return [member for inner in state[key] for member in _flat(inner, key)]


def _splits_at_a_space(state: dict) -> bool:
    """A pre-tokenizer that always starts a pre-token at a space that follows a non-space character."""
    kind = state.get("type")
    if kind == "ByteLevel":
        return bool(state.get("use_regex", True))
    if kind == "Split":
        return (state.get("pattern") or {}).get("Regex") in KNOWN_PATTERNS and state.get("behavior") == "Isolated" \
            and not state.get("invert")
    if kind == "Metaspace":
        return bool(state.get("split", True))
    return kind in ("Whitespace", "WhitespaceSplit", "BertPreTokenizer")


def _normalizer_problem(state: Optional[dict]) -> Optional[str]:
    for member in _flat(state, "normalizers") if state else []:
        kind = member.get("type")
        pattern = (member.get("pattern") or {}).get("String") if kind == "Replace" else None
        if kind in PER_CHARACTER_NORMALIZERS or (isinstance(pattern, str) and len(pattern) == 1
                                                 and not pattern.isascii()):
            continue
        return f"its normalizer {kind} may act across a cut"
    return None


def _pre_tokenizer_problem(state: Optional[dict]) -> Optional[str]:
    if state is None:
        return "the tokenizer has no pre-tokenizer to cut the text at"
    members = _flat(state, "pretokenizers")
    if not _splits_at_a_space(members[0]):
        return f"its pre-tokenizer {members[0].get('type')} is not one whose splits are proven local"
    for member in members[1:]:
        if not (_splits_at_a_space(member) or member.get("type") in ("ByteLevel", "Digits")):
            return f"its pre-tokenizer {member.get('type')} is not one whose splits are proven local"
    return None


def unprovable_reason(backend) -> Optional[str]:
    """Why no cut can be proven safe for this tokenizer (None: the rules above apply to it)."""
    problem = _pre_tokenizer_problem(_state(backend.pre_tokenizer)) or _normalizer_problem(_state(backend.normalizer))
    if problem:
        return problem
    model = type(backend.model).__name__
    if model not in MODELS or getattr(backend.model, "dropout", None):
        return f"its model {model}{' with dropout' if model in MODELS else ''} is not one proven to encode " \
               "pre-tokens alone"
    post_processor = _state(backend.post_processor)
    processors = _flat(post_processor, "processors") if post_processor else []
    unknown = [p.get("type") for p in processors if p.get("type") not in PROCESSORS_OF_SPECIALS]
    return f"its post-processor {unknown[0]} is not one known to add only special tokens" if unknown else None


@dataclass
class AddedTokenWindow:
    """Whether any added token occurs near a cut: contents case-folded (and normalised, for the tokens matched on
    normalised text), looked for in the case-folded text within `reach` characters of the cut."""
    contents: Optional[re.Pattern]   # None: the tokenizer has no added token
    reach: int
    ascii_only: bool                 # the window must be printable ASCII (normalised added tokens, a normalizer)

    @classmethod
    def of(cls, backend) -> "AddedTokenWindow":
        tokens = [t for t in backend.get_added_tokens_decoder().values() if t.content]
        normalizer = backend.normalizer
        contents = {t.content for t in tokens}
        normalised = [t.content for t in tokens if t.normalized] if normalizer is not None else []
        contents |= {normalizer.normalize_str(c) for c in normalised}
        folded = sorted({c.casefold().translate(WHITESPACE_AS_SPACE) for c in contents if c}, key=len, reverse=True)
        if not folded:
            return cls(None, 0, False)
        return cls(re.compile("|".join(map(re.escape, folded))), max(map(len, folded)) + MARGIN, bool(normalised))

    def clear_at(self, text: str, q: int) -> bool:
        if self.contents is None:
            return True
        window = text[max(q - self.reach, 0):q + self.reach]
        if self.ascii_only and NOT_PRINTABLE_ASCII.search(window):
            return False
        return not self.contents.search(window.casefold().translate(WHITESPACE_AS_SPACE))


def cut_candidates(text: str, target: int, search_chars: int, window: AddedTokenWindow, limit: int) -> list[int]:
    """Positions within search_chars of target where the rules allow a cut, nearest first (at most limit)."""
    left = max(target - search_chars, 1)
    near = [m.start() for m in CUT_PATTERN.finditer(text, left, target + search_chars)]   # lookbehind sees left - 1
    allowed = []
    for q in sorted(near, key=lambda q: abs(q - target)):
        if window.clear_at(text, q):
            allowed.append(q)
            if len(allowed) == limit:
                break
    return allowed
