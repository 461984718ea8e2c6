"""The tokenizer a GGUF file describes in its metadata (tokenizer.ggml.*), as llama.cpp reads it: the vocabulary,
merges and special tokens through transformers' own GGUF converter (the one AutoTokenizer.from_pretrained(...,
gguf_file=...) uses), and for a byte-level BPE vocabulary llama.cpp's own pre-tokenizer for the file's
tokenizer.ggml.pre (the converter knows few, and splits others by GPT-2's rule without a word)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from ..config import gguf_local_path
from ..errors import FastpplError, first_line


@dataclass(frozen=True)
class PreTokenizer:
    """llama.cpp's pre-tokenizer of a LLAMA_VOCAB_PRE_TYPE (src/llama-vocab.cpp, llm_tokenizer_bpe): its regexes,
    applied in turn, each splitting the pieces the one before left (a match is a piece, and so is the text between
    two), then every piece's bytes spelled as GPT-2 spells them."""
    regexes: tuple[str, ...]
    ignore_merges: bool = False   # a piece that is itself a token is that token, whatever the merges would make
    add_bos: bool = False         # BOS before a text where the file has no tokenizer.ggml.add_bos_token


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_DEEPSEEK3 = ('[!"#$%&' + r"'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _cased(suffix: str) -> str:
    """llama.cpp's spelling of "\\p{Lu}* \\p{Ll}+, or \\p{Lu}+ \\p{Ll}*" (then suffix): cased in ASCII only."""
    return (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + suffix
            + r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + suffix)


_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+")

_GPT2_LIKE = PreTokenizer((_GPT2,))
_DIGITS_APART = PreTokenizer((r"\p{N}", _GPT2))
_LLAMA3_LIKE = PreTokenizer((_LLAMA3,))
_QWEN2_LIKE = PreTokenizer((_QWEN2,))
_DEEPSEEK3_LIKE = PreTokenizer((r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", _DEEPSEEK3))
_BLOOM_LIKE = PreTokenizer((_BLOOM,))
_GPT4O_LIKE = PreTokenizer((_cased(_CONTRACTIONS + "?") + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
                            r"|\s*[\r\n]+|\s+(?!\S)|\s+",))

# tokenizer.ggml.pre -> its pre-tokenizer, for the names llama.cpp knows whose rules fastppl reproduces id for id
# (tests/data/test_gguf_tokenizer.py holds llama-tokenize's ids for each); others are refused
PRE_TOKENIZERS = {
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"), PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)),
    "dbrx": _LLAMA3_LIKE, "smaug-bpe": _LLAMA3_LIKE,
    "chatglm-bpe": _LLAMA3_LIKE, "glm4": PreTokenizer((_LLAMA3,), ignore_merges=True),
    "glm5": PreTokenizer((_LLAMA3,), ignore_merges=True),
    "jais-2": PreTokenizer((_LLAMA3.replace(r"|\s+(?!\S)|\s+", "") + "".join(
        rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4, "1,2")) + r"|\s{1}",)),
    "deepseek-llm": PreTokenizer(("[\r\n]", _DEEPSEEK_LLM_LETTERS, "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f"
                                  "\u3000-\u3002]+", r"\s+$", _CJK, r"\p{N}+")),
    "deepseek-coder": PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"), _DEEPSEEK3_LIKE),
    "spark2_5": PreTokenizer((r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                              _DEEPSEEK3.replace(r"[\r\n]*|\s*[\r\n]+", r"|[\r\n]"), r"\p{N}")),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
                    _DIGITS_APART),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"),
                    _GPT2_LIKE),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
                     "solar-open", "grok-2"), _QWEN2_LIKE),
    "qwen35": PreTokenizer((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                            r"|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), _BLOOM_LIKE),
    "viking": PreTokenizer((_BLOOM, r"\p{N}")),
    "tekken": PreTokenizer((_cased("") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
                           ignore_merges=True, add_bos=True),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_LIKE),
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), PreTokenizer((
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]|\s+(?!\S)|\s+",))),
    "seed-coder": PreTokenizer((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
                                r"|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    "ufakzeka": PreTokenizer((_QWEN2[len(_CONTRACTIONS) + 1:],)),
    "laguna": PreTokenizer((r"[^\n]+|[\n]+", _QWEN2)),
    "exaone-moe": PreTokenizer((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                                r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",)),
    "minicpm5": PreTokenizer((r"\p{N}{1,3}", _QWEN2.replace(r"\p{N}|", r"\p{N}+|")), ignore_merges=True),
}


def _converted(path: Path):
    """(tokenizers.Tokenizer, the tokenizer's settings: tokenizer.ggml.* renamed as transformers names them)."""
    try:   # transformers 5: a metadata reader of its own
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer
        architecture, settings, extra = get_gguf_tokenizer(str(path))
    except ImportError:   # transformers 4
        from transformers.integrations.ggml import convert_gguf_tokenizer
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
        parsed = load_gguf_checkpoint(str(path))
        architecture, settings, extra = parsed["config"]["model_type"], parsed["tokenizer"], parsed["tokenizer_config"]
    backend, _ = convert_gguf_tokenizer(architecture, settings)
    return backend, {**settings, **extra}


def llama_cpp_pre_tokenizer(path: Path, settings: dict):
    """The PreTokenizer of a byte-level BPE file (tokenizer.ggml.model gpt2) as llama.cpp reads it, None for
    another vocabulary (sentencepiece's has no pre-tokenizer); a name fastppl cannot reproduce is refused."""
    if settings.get("tokenizer_type") != "gpt2":
        return None
    name = settings.get("pre_tokenizer_type") or "default"   # llama.cpp: none named is 'default'
    if name not in PRE_TOKENIZERS:
        raise FastpplError(f"{path}: its tokenizer.ggml.pre {name!r} is a pre-tokenizer fastppl does not reproduce "
                           "as llama.cpp does; pass --tokenizer PATH to the model's tokenizer directory")
    return PRE_TOKENIZERS[name]


def _use_pre_tokenizer(backend, pre: PreTokenizer) -> None:
    from tokenizers import Regex, pre_tokenizers
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    backend.model.ignore_merges = pre.ignore_merges


def gguf_tokenizer_fields(spec: str) -> dict:
    """The fields of a fastppl.data.tokenize.Tokenizer (all but its name) for a GGUF file's tokenizer."""
    path = gguf_local_path(spec, "--model or --tokenizer")
    try:
        backend, settings = _converted(path)
    except FastpplError:
        raise
    except Exception as e:   # a damaged file, or a tokenizer type transformers cannot build
        raise FastpplError(f"{path}: no tokenizer can be built from its GGUF metadata ({first_line(e)}); pass "
                           "--tokenizer PATH to the model's tokenizer directory") from None
    pre = llama_cpp_pre_tokenizer(path, settings)
    if pre is not None:
        _use_pre_tokenizer(backend, pre)
    bos_id, eos_id = settings.get("bos_token_id"), settings.get("eos_token_id")
    add_bos = settings.get("add_bos_token", pre is not None and pre.add_bos)
    _add_bos_as_llama_cpp_does(backend, bos_id if add_bos else None)
    fingerprint = hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()[:16]
    return dict(backend=backend, fingerprint=fingerprint, bos_id=bos_id if bos_id is not None else eos_id,
                eos_id=eos_id, vocab_size=backend.get_vocab_size(with_added_tokens=True))


def _add_bos_as_llama_cpp_does(backend, bos_id) -> None:
    """The text's default prefix (Tokenizer.default_prefix): BOS where the file's add_bos_token says so, as
    llama.cpp tokenizes, else nothing."""
    from tokenizers import processors
    if bos_id is None:
        if backend.encode("a", add_special_tokens=True).ids != backend.encode("a", add_special_tokens=False).ids:
            backend.post_processor = None
        return
    bos = backend.id_to_token(bos_id)
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, bos_id)])
