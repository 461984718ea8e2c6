"""`fastppl generate`: continue prompts with a native model and a static KV cache."""
from __future__ import annotations

import argparse

from ..config import check_model_spec
from ..errors import FastpplError
from .args import DEVICE_HELP, DTYPE_HELP, MODEL_HELP, TOKENIZER_HELP, check_model_given, seed


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="continue prompts with a native model and a static KV cache",
                       description="Continue prompts with a native model (GPT-2 or the Llama family) and a static "
                                   "KV cache; prints each completion and the decode speed.")
    p.add_argument("--model", required=True, help="a native GPT-2 or Llama-family model: " + MODEL_HELP)
    p.add_argument("--tokenizer", help=TOKENIZER_HELP)
    p.add_argument("--prompt", action="append",
                   help="a prompt; repeatable (prompts run as one batch) (default: none; give --prompt or --prompts)")
    p.add_argument("--prompts", help="file of prompts, one per line; \\n inside a line is a newline, blank lines are "
                                     "skipped (default: none)")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="new tokens per prompt; a completion ends early at the tokenizer's end-of-text token "
                        "(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 decodes greedily (default: %(default)s)")
    p.add_argument("--top-k", type=int, help="sample from the k most likely tokens (default: all tokens)")
    p.add_argument("--top-p", type=float,
                   help="sample from the smallest set of tokens whose probability reaches p (default: all tokens)")
    p.add_argument("--seed", type=seed, help="sampling seed (default: 0)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"], help=DTYPE_HELP)
    p.add_argument("--backend", default="auto", choices=["auto", "native"],
                   help="auto and native both run fastppl's own GPT-2 or Llama-family model (generate has no "
                        "transformers backend) (default: %(default)s)")
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                   help="decode step under torch.compile + CUDA graphs (default: %(default)s: on CUDA, off on cpu)")
    p.add_argument("--json", help="write completions and timings here (default: not written)")
    p.set_defaults(run=run_generate)
    return p


def _check_sampling(args: argparse.Namespace) -> None:
    sampling_only = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p), ("--seed", args.seed))
                     if value is not None]
    if sampling_only and args.temperature == 0:
        verb = "apply" if len(sampling_only) > 1 else "applies"
        raise FastpplError(f"{', '.join(sampling_only)} {verb} to sampling, and --temperature 0 decodes greedily; "
                           "set --temperature > 0 or drop them")


def run_generate(args: argparse.Namespace) -> int:
    from ..generate import GenerateConfig, Sampling, generation_summary, read_prompts, run_generate as generate
    from ..report.files import check_distinct_outputs, check_writable, files_in, write_json

    inputs = [*([args.prompts] if args.prompts and args.prompts.strip() else []), *files_in(args.model),
              *files_in(args.tokenizer)]
    check_distinct_outputs({"--json": args.json}, inputs=inputs)
    if args.json:
        check_writable(args.json, "--json")
    check_model_spec(args.tokenizer, "--tokenizer")
    check_model_given(args.model)
    _check_sampling(args)
    given = args.prompt or []
    for prompt in given:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:   # argv bytes that are not UTF-8 arrive as surrogates
            raise FastpplError("a --prompt is not valid UTF-8 text; pass it in a UTF-8 file with --prompts") from None
    prompts = list(given) + (read_prompts(args.prompts) if args.prompts is not None else [])
    config = GenerateConfig(
        model=args.model, prompts=prompts, max_new_tokens=args.max_new_tokens, tokenizer=args.tokenizer,
        sampling=Sampling(args.temperature, args.top_k, args.top_p, 0 if args.seed is None else args.seed),
        device=args.device, dtype=args.dtype, backend=args.backend, compile=args.compile,
    )
    result = generate(config)
    if args.json:
        write_json(args.json, result)
    print(generation_summary(result))
    return 0
