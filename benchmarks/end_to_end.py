"""`fastppl eval` end to end: seconds from process start to exit, for a first run on empty caches and the runs after
it, with the report's time inside `evaluate` and its stage_seconds (where the time went).

    PYTHONPATH=src python benchmarks/end_to_end.py                 # random:gpt2 on all of TinyShakespeare
    PYTHONPATH=src python benchmarks/end_to_end.py --checkpoint --runs 4
    PYTHONPATH=src python benchmarks/end_to_end.py --model random:gpt2-tiny --device cpu --runs 2 -- --ctx 64

Each run is a fresh `python -m fastppl eval ... --split all --quiet --json` process, timed from before its start to
after its exit (interpreter start, `import torch`, the CUDA context and teardown included). Unless --keep-caches,
the runs share a new temporary cache folder (FASTPPL_CACHE_DIR: token ids, Inductor; TRITON_CACHE_DIR), so the
first run is cold as on a fresh machine and the later ones are warm. --checkpoint first writes the random: GPT-2
preset's weights as a Hugging Face checkpoint folder and evaluates that, so that load_model reads weights from disk
as for a real model. Arguments after `--` go to `fastppl eval` as they are. The tokenizer and corpus default to
../shared/data beside the checkout (or FASTPPL_SHARED_DATA), as the tests'."""
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


def save_checkpoint(spec: str, directory: Path) -> str:
    """Write random:<gpt2 preset> as a Hugging Face checkpoint folder; returns the folder for --model."""
    sys.path.insert(0, str(ROOT / "src"))
    from fastppl.models.loading import RANDOM_PREFIX, random_gpt2, save_hf_gpt2
    if not spec.startswith(RANDOM_PREFIX + "gpt2"):
        raise SystemExit(f"--checkpoint writes random:gpt2* presets only, not {spec}; pass a checkpoint as --model")
    save_hf_gpt2(random_gpt2(spec[len(RANDOM_PREFIX):], 0), directory)
    return str(directory)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:gpt2", help="random:<preset> or a checkpoint folder")
    parser.add_argument("--checkpoint", action="store_true",
                        help="save the random: preset as a checkpoint folder first and evaluate that")
    parser.add_argument("--tokenizer", default=str(SHARED_DATA / "gpt2-tokenizer"))
    parser.add_argument("--data", default=str(SHARED_DATA / "tinyshakespeare.txt"))
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
        model = save_checkpoint(args.model, scratch / "checkpoint") if args.checkpoint else args.model
        floor = None
        if args.floor:
            started = time.perf_counter()
            subprocess.run([sys.executable, "-c", "import torch"], env=env, check=True)
            floor = time.perf_counter() - started
        reports, walls = [], []
        for run in range(args.runs):
            out = scratch / f"run{run}.json"
            command = [sys.executable, "-m", "fastppl", "eval", "--model", model, "--tokenizer", args.tokenizer,
                       "--data", args.data, "--split", args.split, "--device", args.device, "--quiet",
                       "--json", str(out), *extra]
            started = time.perf_counter()
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            walls.append(time.perf_counter() - started)
            if done.returncode != 0:
                sys.stderr.write(done.stderr[-4000:])
                print(f"run {run + 1} failed (exit {done.returncode}): {' '.join(command)}")
                return 1
            reports.append(json.loads(out.read_text()))

    first = reports[0]
    print(f"fastppl eval --model {args.model}{' (saved as a checkpoint)' if args.checkpoint else ''} "
          f"--split {args.split}: {first['tokens_scored']:,} tokens, {first['environment'].get('device_name')}, "
          f"torch {first['environment'].get('torch')}, {'usual' if args.keep_caches else 'fresh'} caches")
    if floor is not None:
        print(f"python -c 'import torch': {floor:.2f} s")
    print("| run | wall s (process start to exit) | in evaluate s | scoring s | tokens/s | batch | nll |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for run, (wall, r) in enumerate(zip(walls, reports)):
        name = "1 (cold)" if run == 0 and not args.keep_caches else str(run + 1)
        print(f"| {name} | {wall:.2f} | {r['wall_seconds']:.2f} | {r['scoring_seconds']:.2f} | "
              f"{r['tokens_per_second'] or 0:,.0f} | {r['batch_size']} | {r['nll']:.6f} |")
    stages = list(dict.fromkeys(k for r in reports for k in r.get("stage_seconds", {})))
    print("\n| stage s | " + " | ".join(f"run {i + 1}" for i in range(len(reports))) + " |")
    print("| --- |" + " --- |" * len(reports))
    for stage in stages:
        print(f"| {stage} | " + " | ".join(f"{r['stage_seconds'].get(stage, float('nan')):.2f}" for r in reports)
              + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
