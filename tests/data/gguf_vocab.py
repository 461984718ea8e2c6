"""GGUF files of a tokenizer alone (no tensors), for the tokenizer's tests: GPT-2's byte-level BPE cut to its
first merges, under any tokenizer.ggml.pre. llama.cpp's llama-tokenize reads these files too (it loads the
vocabulary only), which is how tests/data/llama_cpp_tokenize.json was made."""
import json
from pathlib import Path
from typing import Optional

N_MERGES = 8000   # GPT-2's first merges: its tokens 256.. are their results, in order
# merges GPT-2 lacks, so that a run of spaces, tabs or newlines is a token where a piece holds it whole
WHITESPACE_MERGES = ["Ġ Ġ", "ĠĠ Ġ", "ĠĠ ĠĠ", "ĉ ĉ",
                     "Ċ Ġ", "ĊĠ Ġ"]
# tokens no merge makes: a piece that is one of them is that token only where merges are ignored (llama3's rule);
# <think> is USER_DEFINED (matched in the text as llama.cpp matches it), <|endoftext|> CONTROL
WHOLE_TOKENS = ["ĠHelloWorld", "<think>"]


def write_vocab_gguf(path: Path, tokenizer_dir: Path, pre: Optional[str], add_bos: Optional[bool] = False) -> Path:
    """A GGUF of GPT-2's 256 byte tokens, its first N_MERGES merges, the whitespace merges, WHOLE_TOKENS and
    <|endoftext|> (BOS and EOS), with tokenizer.ggml.pre = pre (None: no key) and add_bos_token = add_bos (None:
    no key)."""
    import gguf
    vocab = json.loads((tokenizer_dir / "vocab.json").read_text(encoding="utf-8"))
    merges = (tokenizer_dir / "merges.txt").read_text(encoding="utf-8").splitlines()[1:1 + N_MERGES]
    merges += WHITESPACE_MERGES
    tokens = sorted((t for t, i in vocab.items() if i < 256 + N_MERGES), key=vocab.get)
    tokens += [m.replace(" ", "") for m in WHITESPACE_MERGES] + WHOLE_TOKENS + ["<|endoftext|>"]
    writer = gguf.GGUFWriter(str(path), "gpt2")
    for add, value in ((writer.add_context_length, 64), (writer.add_embedding_length, 8),
                       (writer.add_feed_forward_length, 32), (writer.add_block_count, 1), (writer.add_head_count, 1),
                       (writer.add_layer_norm_eps, 1e-5)):
        add(value)
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([4 if t == "<think>" else 3 if t == "<|endoftext|>" else 1 for t in tokens])
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
