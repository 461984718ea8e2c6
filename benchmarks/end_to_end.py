"""`fastppl eval` end to end: seconds from process start to exit, for a first run on empty caches and the runs after
it, with the report's time inside `evaluate`, its stage_seconds (where the time went) and its peak host memory.

    PYTHONPATH=src python benchmarks/end_to_end.py                 # random:gpt2 on all of TinyShakespeare
    PYTHONPATH=src python benchmarks/end_to_end.py --checkpoint --repeat 30 --runs 2
    PYTHONPATH=src python benchmarks/end_to_end.py --model random:llama-1b --checkpoint -- --ctx 2048
    PYTHONPATH=src python benchmarks/end_to_end.py --model path/to/checkpoint --data corpus.txt
    PYTHONPATH=src python benchmarks/end_to_end.py --model random:gpt2-tiny --device cpu --runs 2 -- --ctx 64

Each run is a fresh `python -m fastppl eval ... --split all --quiet --json` process, timed from before its start to
after its exit (interpreter start, `import torch`, the CUDA context and teardown included). Unless --keep-caches,
the runs share a new temporary cache folder (FASTPPL_CACHE_DIR: token ids, Inductor; TRITON_CACHE_DIR), so the
first run is cold as on a fresh machine (its corpus not yet in the token cache) and the later ones are warm.
--checkpoint first writes the random: preset's weights as a Hugging Face checkpoint folder (--checkpoint-dtype:
GPT-2 presets in fp32 and Llama presets in bf16 by default, as those models are published) and evaluates that,
so that load_model reads weights from disk as for a real model; --model also takes a checkpoint folder as it is.
--repeat N evaluates the corpus written N times over into one file (a large first run to tokenize). Arguments
after `--` go to `fastppl eval` as they are. The tokenizer and corpus default to ../shared/data beside the
checkout (or FASTPPL_SHARED_DATA), as the tests'."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("FASTPPL_SHARED_DATA", ROOT.parent / "shared" / "data"))


def save_checkpoint(spec: str, directory: Path, dtype: str) -> str:
    """Write random:<preset> as a Hugging Face checkpoint folder in dtype; returns the folder for --model."""
    sys.path.insert(0, str(ROOT / "src"))
    import torch
    from fastppl.models.loading import RANDOM_PREFIX, random_native, save_hf_checkpoint
    if not spec.startswith(RANDOM_PREFIX):
        raise SystemExit(f"--checkpoint writes random: presets only, not {spec}; pass a checkpoint as --model")
    preset = spec[len(RANDOM_PREFIX):]
    dtype = dtype or ("bf16" if preset.startswith("llama") else "fp32")
    save_hf_checkpoint(random_native(preset, 0), directory, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    return str(directory)


def repeated(data: str, times: int, scratch: Path) -> str:
    """The corpus written `times` times over into one file (the file itself for 1)."""
    if times == 1:
        return data
    text = Path(data).read_text(encoding="utf-8")
    path = scratch / f"{Path(data).stem}-x{times}.txt"
    path.write_text(text * times, encoding="utf-8")
    return str(path)


def weights_bytes(model: str) -> int:
    """The bytes of a checkpoint folder's weight files (0 for random: weights)."""
    folder = Path(model)
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder.is_dir() else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:gpt2", help="random:<preset> or a checkpoint folder")
    parser.add_argument("--checkpoint", action="store_true",
                        help="save the random: preset as a checkpoint folder first and evaluate that")
    parser.add_argument("--checkpoint-dtype", choices=["fp32", "bf16"],
                        help="the saved weights' dtype (default: fp32 for GPT-2 presets, bf16 for Llama presets)")
    parser.add_argument("--tokenizer", default=str(SHARED_DATA / "gpt2-tokenizer"))
    parser.add_argument("--data", default=str(SHARED_DATA / "tinyshakespeare.txt"))
    parser.add_argument("--repeat", type=int, default=1, help="evaluate the corpus written this many times over")
    parser.add_argument("--split", default="all", choices=["train", "val", "all"])
    parser.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    parser.add_argument("--runs", type=int, default=3, help="runs in all: the first cold, the rest warm")
    parser.add_argument("--keep-caches", action="store_true",
                        help="use the usual cache folders (the first run is then as warm as they are)")
    parser.add_argument("--floor", action="store_true",
                        help="also time `python -c 'import torch'`, the floor under every run")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="fastppl-end-to-end-") as scratch:
        scratch = Path(scratch)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                                         os.environ.get("PYTHONPATH")])))
        if not args.keep_caches:
            env.update(FASTPPL_CACHE_DIR=str(scratch / "cache"), TRITON_CACHE_DIR=str(scratch / "triton"))
        model = (save_checkpoint(args.model, scratch / "checkpoint", args.checkpoint_dtype) if args.checkpoint
                 else args.model)
        data, checkpoint_bytes = repeated(args.data, args.repeat, scratch), weights_bytes(model)
        floor = None
        if args.floor:
            started = time.perf_counter()
            subprocess.run([sys.executable, "-c", "import torch"], env=env, check=True)
            floor = time.perf_counter() - started
        reports, walls = [], []
        for run in range(args.runs):
            out = scratch / f"run{run}.json"
            command = [sys.executable, "-m", "fastppl", "eval", "--model", model, "--tokenizer", args.tokenizer,
                       "--data", data, "--split", args.split, "--device", args.device, "--quiet",
                       "--json", str(out), *extra]
            started = time.perf_counter()
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            walls.append(time.perf_counter() - started)
            if done.returncode != 0:
                sys.stderr.write(done.stderr[-4000:])
                print(f"run {run + 1} failed (exit {done.returncode}): {' '.join(command)}")
                return 1
            reports.append(json.loads(out.read_text()))

    print_tables(args, reports, walls, floor, checkpoint_bytes)
    return 0


def print_tables(args, reports: list[dict], walls: list[float], floor, checkpoint_bytes: int) -> None:
    first = reports[0]
    print(f"fastppl eval --model {args.model}{' (saved as a checkpoint)' if args.checkpoint else ''} "
          f"--split {args.split}{f' (the corpus {args.repeat} times over)' if args.repeat > 1 else ''}: "
          f"{first['tokens_scored']:,} tokens, {first['environment'].get('device_name')}, "
          f"torch {first['environment'].get('torch')}, {'usual' if args.keep_caches else 'fresh'} caches")
    if checkpoint_bytes:
        print(f"weight files: {checkpoint_bytes / 1e9:.3f} GB")
    if floor is not None:
        print(f"python -c 'import torch': {floor:.2f} s")
    print("| run | wall s (process start to exit) | in evaluate s | scoring s | wall / scoring | tokens/s | "
          "peak host GB | batch | nll |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for run, (wall, r) in enumerate(zip(walls, reports)):
        name = "1 (cold)" if run == 0 and not args.keep_caches else str(run + 1)
        peak = r.get("peak_host_memory_bytes") or 0
        peak_note = f" ({peak / checkpoint_bytes:.2f}x the weights)" if checkpoint_bytes else ""
        print(f"| {name} | {wall:.2f} | {r['wall_seconds']:.2f} | {r['scoring_seconds']:.2f} | "
              f"{wall / r['scoring_seconds']:.2f} | {r['tokens_per_second'] or 0:,.0f} | {peak / 1e9:.2f}{peak_note} | "
              f"{r['batch_size']} | {r['nll']:.6f} |")
    stages = list(dict.fromkeys(k for r in reports for k in r.get("stage_seconds", {})))
    print("\n| stage s | " + " | ".join(f"run {i + 1}" for i in range(len(reports))) + " |")
    print("| --- |" + " --- |" * len(reports))
    for stage in stages:
        print(f"| {stage} | " + " | ".join(f"{r['stage_seconds'].get(stage, float('nan')):.2f}" for r in reports)
              + " |")
    print("tokenize and cuda_start ran on threads of their own beside the other stages (docs/speed.md)")


if __name__ == "__main__":
    raise SystemExit(main())
