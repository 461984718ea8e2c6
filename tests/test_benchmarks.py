"""The maintained benchmark scripts under benchmarks/ run: each with tiny CPU arguments in its own process (all four
at once), exits 0 and prints its table."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@pytest.mark.slow   # every script in its own process
def test_every_benchmark_script_runs_on_the_cpu_and_prints_its_table(tmp_path, tokenizer_dir):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Now is the winter of our discontent made glorious summer by this sun of York.\n" * 12)
    runs = {
        "loss.py": (["--device", "cpu", "--shapes", "tiny", "--rounds", "1", "--reps", "2"],
                    ["| shape (N x C x V) | loss |", "| tiny 256 x 64 x 1,000 | chunked (8192 rows), eager |",
                     "skipped: the fused loss"]),
        "scorer.py": (["--device", "cpu", "--model", "gpt2-tiny", "--batch", "2", "--seq", "32", "--rounds", "1",
                       "--batches", "2", "--warmup", "1"],
                      ["| variant | what runs |", "| eager | chunked loss, eager", "skipped compiled:"]),
        "decode_step.py": (["--device", "cpu", "--model", "gpt2-tiny", "--batch-sizes", "1,2", "--new-tokens", "4",
                            "--prompt-tokens", "8", "--runs", "1"],
                           ["| batch | variant | decode step |", "| 1 | default | eager |", "| 2 | default | eager |"]),
        "end_to_end.py": (["--model", "random:llama-tiny", "--checkpoint", "--device", "cpu", "--runs", "2",
                           "--repeat", "3", "--tokenizer", str(tokenizer_dir), "--data", str(corpus), "--", "--ctx",
                           "32"],
                          ["| run | wall s (process start to exit) |", "| 1 (cold) |", "| 2 |", "| scoring |",
                           "| wait_for_tokenize |", "(the corpus 3 times over)", "weight files: 0.013 GB",
                           "x the weights) |"]),
    }
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    started = {name: subprocess.Popen([sys.executable, str(BENCHMARKS / name), *arguments], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for name, (arguments, _) in runs.items()}
    for name, process in started.items():
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, f"{name} exited {process.returncode}:\n{stdout}\n{stderr[-3000:]}"
        for expected in runs[name][1]:
            assert expected in stdout, f"{name} printed no {expected!r}:\n{stdout}"


def test_the_readme_names_every_script_and_there_are_at_most_five():
    scripts = sorted(p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh"))
    assert 1 <= len(scripts) <= 5, scripts
    readme = (BENCHMARKS / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in scripts), scripts
