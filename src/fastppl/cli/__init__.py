"""The command line: one module per subcommand (eval, bench, generate, compare), each a thin mapping from
arguments onto configs; here the parser that holds them, and the error handling of every command.

User errors (FastpplError, bad arguments) exit 2 with one line "fastppl: error: ..." and no traceback."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from .. import __version__
from ..config import cli_spelling
from ..errors import FastpplError
from . import bench, compare, eval as eval_command, generate
from .args import Parser

__all__ = ["build_parser", "main", "run"]


# what each command's out-of-memory error says to lower
OUT_OF_MEMORY_ADVICE = {
    "eval": "lower --batch-size or --ctx, or use a smaller model",
    "bench": "lower --batch-size or --seq (generation: --batch-sizes, --prompt-tokens or --new-tokens)",
    "generate": "give fewer prompts or a lower --max-new-tokens, or use a smaller model",
    "compare": "compare fewer or smaller files",
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fastppl", description="Exact perplexity of causal language models, fast.")
    parser.add_argument("--version", action="version", version=f"fastppl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (eval_command, bench, generate, compare):
        command.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..launch import stop_silently_on_interrupt   # here: `python -m fastppl.launch` imports this package
    stop_silently_on_interrupt()   # a rank that --nproc started
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)   # for --nproc, which re-runs the command
    if getattr(args, "device", "cpu") != "cpu" and getattr(args, "nproc", None) in (None, 1):   # not torchrun's parent
        from ..accel.warm_up import start_triton_warm_up
        start_triton_warm_up()   # overlaps the `import torch` that the command is about to do
    try:
        with cli_spelling():   # its errors name options as the command line spells them
            return args.run(args)
    except FastpplError as e:
        if not getattr(e, "silent", False):   # a rank's copy of another rank's error: rank 0 prints it
            if "torch" in sys.modules:   # only a run that imported torch can be a rank
                from ..distributed import delay_a_ranks_error
                delay_a_ranks_error()
            print(f"fastppl: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)   # a peer's crash (PeerFailed) is not bad input
    except KeyboardInterrupt:
        resume = getattr(args, "resume", None)
        print("fastppl: interrupted" + (f"; run the same command again to go on from the last checkpoint in {resume}"
                                        if resume else ""), file=sys.stderr)
        return 130
    except (RuntimeError, MemoryError) as e:
        from ..errors import allocation_gib, first_line, is_memory_exhausted
        if not is_memory_exhausted(e):
            raise   # a real failure, with its traceback
        # what --batch-size auto does not cover (a fixed batch, bench's batch sizes, generate's prompts)
        gib = allocation_gib(e)
        what = f"could not allocate {gib:,.2f} GiB" if gib is not None else first_line(e)
        print(f"fastppl: error: out of memory ({what}); {OUT_OF_MEMORY_ADVICE[args.command]}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader of stdout left early (`fastppl eval ... | head -1`); output files are written before printing.
        # stdout goes to /dev/null so that the interpreter's last flush does not fail again on the way out.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141   # 128 + SIGPIPE, what a shell reports for a writer killed by its pipe
    except OSError as e:   # a path the checks above did not foresee (too long, unreadable, ...)
        if e.filename is None:
            raise   # not about a path the user gave: a real failure, with its traceback
        from ..config import cache_dir
        cache = str(cache_dir())
        in_cache = str(e.filename) == cache or str(e.filename).startswith(cache.rstrip(os.sep) + os.sep)
        hint = (f"fastppl's cache is {cache}; point FASTPPL_CACHE_DIR at a writable directory" if in_cache
                else "check the paths given")
        print(f"fastppl: error: {e.strerror or e}: {e.filename}; {hint}", file=sys.stderr)
        return 2


def run() -> None:
    """The `fastppl` command. A process that used CUDA leaves without the interpreter's teardown (0.6 s on an
    H200): by now every output file is written and closed, and the driver frees the device. A rank of a
    process group exits normally, so that the group is torn down."""
    code = main()
    torch = sys.modules.get("torch")
    if (torch is not None and torch.cuda.is_initialized()
            and not (torch.distributed.is_available() and torch.distributed.is_initialized())):
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:   # the reader of a pipe has gone: nothing more can reach it
            pass
        os._exit(code)
    sys.exit(code)
