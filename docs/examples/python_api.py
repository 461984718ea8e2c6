"""fastppl's Python API on the CPU, with no network. Run it from the repository root:

    python docs/examples/python_api.py

It reads the GPT-2 tokenizer and TinyShakespeare from ../shared/data (or the folder FASTPPL_SHARED_DATA names)."""
import json
import os
import pathlib
import shutil
import tempfile

import torch

import fastppl

shared = pathlib.Path(os.environ.get("FASTPPL_SHARED_DATA", "../shared/data"))
tokenizer = str(shared / "gpt2-tokenizer")

# A corpus of three documents: a .jsonl file holds one per line, in the field "text".
text = (shared / "tinyshakespeare.txt").read_text(encoding="utf-8")
workdir = pathlib.Path(tempfile.mkdtemp())
corpus = workdir / "three.jsonl"
corpus.write_text("".join(json.dumps({"text": text[i:i + 2000]}) + "\n" for i in (0, 2000, 4000)), encoding="utf-8")

# 1. evaluate(config) -> EvalResult: typed fields (result.metrics.nll, result.timings.stage_seconds, ...);
# result["nll"] reads a field of the report that `fastppl eval --json` writes, result.to_dict() is that report.
config = fastppl.EvalConfig(model="random:gpt2-tiny", data=[str(corpus)], tokenizer=tokenizer,
                            device="cpu", ctx=128, per_doc="collect", quiet=True)
result = fastppl.evaluate(config)
print(f"{result.corpus.documents} documents, {result.metrics.tokens_scored:,} tokens scored")
print(f"nll {result.metrics.nll:.6f}  ppl {result['ppl']:.2f}  bits/byte {result['bits_per_byte']:.6f}")
print(f"batching: {result['batching_reason']}; compile {result['compile']}")
# per_doc (or per_token) set: the per-document sums (per-token array) come back as result.per_doc
# (result.per_token); evaluate() writes no file, the CLI does
for doc in result.per_doc:
    print(f"  {pathlib.Path(doc['id']).name}: {doc['tokens']} tokens, nll {doc['nll_sum'] / doc['tokens']:.4f}")

# 2. Bad input raises FastpplError, with the one-line message the CLI prints, naming EvalConfig's fields.
try:
    fastppl.evaluate(fastppl.EvalConfig(model="random:gpt2-tiny", data=[str(corpus)], tokenizer=tokenizer,
                                        device="cpu", ctx=4096))
except fastppl.FastpplError as error:
    print("FastpplError:", error)
try:
    fastppl.EvalConfig(model="random:gpt2-tiny", data=[str(corpus)], window="rolling")   # checked on creation
except fastppl.FastpplError as error:
    print("FastpplError:", error)

# 3. load_model(spec, backend, dtype, seed): the model alone, in eval mode; forward gives the final hidden
#    states, lm_head the logits.
model = fastppl.load_model("random:gpt2-tiny", dtype=torch.float32, seed=0)
print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} parameters, "
      f"{model.max_positions} positions, vocabulary {model.vocab_size:,}")
ids = torch.tensor([[50256, 2514, 307, 11, 393, 407, 284, 307]])   # <|endoftext|> To be, or not to be
with torch.no_grad():
    logits = model.lm_head(model(ids)).float()
nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
print(f"hand-made NLL of 7 tokens: {nll.item():.6f}")
shutil.rmtree(workdir)
