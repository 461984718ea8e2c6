"""The maintained benchmark scripts under benchmarks/ run: each with tiny CPU arguments in its own process (side by
side, or in gpu_check.py's --quick run), exits 0 and prints its table; gpu_check.py's pytest stage and its --quick
run."""
import importlib.util
import json
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
    # loss.py and scorer.py run in the GPU check's --quick run below, with these arguments and these lines checked
    runs = {
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


def test_the_readme_names_every_script_and_there_are_at_most_seven():
    scripts = sorted(p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh"))
    assert 1 <= len(scripts) <= 7, scripts
    readme = (BENCHMARKS / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in scripts), scripts


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", BENCHMARKS / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_gpu_checks_pytest_stage_records_failures_as_they_happen_and_interrupts_a_hung_test(tmp_path):
    """gpu_check's pytest stage on three tests of its own: the failure is in failures.txt, the test past
    --test-timeout is interrupted (a failure too) and the test after it still runs; counts by file."""
    gpu_check = _gpu_check()
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_three.py").write_text(
        "import time\nimport pytest\n\n"
        "@pytest.mark.gpu\ndef test_fails():\n    assert 1 == 2\n\n"
        "@pytest.mark.gpu\ndef test_hangs():\n    time.sleep(60)\n\n"
        "@pytest.mark.gpu\ndef test_passes():\n    pass\n\n"
        "def test_not_marked():\n    pass\n")
    args = type("Args", (), {"test_timeout": 2.0, "tests": [str(tests)]})()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    process = gpu_check.start_pytest(args, tmp_path, env, tmp_path)
    status, seconds = gpu_check.finish(process, 50)
    files, failed, running = gpu_check.test_counts(process.events)
    assert status == "exit 1" and seconds < 40 and running is None
    assert [path.endswith("test_three.py") for path in files] == [True]
    assert list(files.values()) == [{"passed": 1, "failed": 2, "error": 0, "skipped": 0, "not run": 0}]
    assert [f.split("::")[-1] for f in failed] == ["test_fails", "test_hangs"]
    failures = (tmp_path / "failures.txt").read_text().splitlines()
    assert [line.split("::")[-1] for line in failures] == ["test_fails", "test_hangs"]
    assert all(line.startswith("FAILED ") for line in failures)
    assert "TestTimedOut" in (tmp_path / "pytest.log").read_text()


@pytest.mark.slow
def test_gpu_check_quick_writes_its_table_and_files(tmp_path, tokenizer_dir, shakespeare):
    """benchmarks/gpu_check.py --quick on the CPU: the GPU-marked tests skip, every benchmark gives its figures
    beside their peers, one table (printed and in summary.md) and at most six files."""
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), str(out), "--quick", "--budget", "400",
                           "--tokenizer", str(tokenizer_dir), "--data", str(shakespeare),
                           "--tests", "tests/test_gpu.py"],   # one file: collecting the whole suite took 14 s
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), capture_output=True, text=True,
                          timeout=450, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["bench.log", "failures.txt", "pytest.log", "results.json",
                                                     "summary.md"]
    table = (out / "summary.md").read_text()
    assert table in done.stdout and (out / "failures.txt").read_text() == ""
    lines = table.splitlines()
    assert lines[0].startswith("GPU check on CPU: torch ") and "triton" in lines[0] and "transformers" in lines[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:] if line.startswith("| ")]
    assert rows[0] == ["check", "fastppl", "peer (same run)", "speed-up", "status"]
    rows = {r[0]: r for r in rows[2:]}
    assert all(len(r) == 5 and r[4] == "ok" for r in rows.values()), rows
    assert " 0 failed, 0 error, " in rows["pytest -m gpu, all files"][1] and "tests/test_gpu.py" in rows
    figures = [name for name in rows if ":" in name]
    for prefix in ("loss, tiny", "scorer: tokens/s", "end to end: wall s", "divergence: tokens/s, one pass vs "
                   "stored logits", "divergence: tokens/s, one pass vs fastppl eval (model alone)"):
        name = next(n for n in figures if n.startswith(prefix))
        assert rows[name][3].endswith("x") or prefix.startswith("scorer"), rows[name]
    results = json.loads((out / "results.json").read_text())
    assert results["environment"]["device"] == "CPU" and set(results["benchmarks"]) == {
        "loss", "scorer", "end_to_end", "divergence"}
    # the scripts' own tables (their runs in test_every_benchmark_script_runs_on_the_cpu_and_prints_its_table else)
    log = (out / "bench.log").read_text()
    assert "--shapes tiny --rounds 1 --reps 2" in log and "--batch 2 --seq 32 --rounds 1 --batches 2" in log
    for expected in ("| shape (N x C x V) | loss |", "| tiny 256 x 64 x 1,000 | chunked (8192 rows), eager |",
                     "skipped: the fused loss", "| variant | what runs |", "| eager | chunked loss, eager",
                     "skipped compiled:"):
        assert expected in log, f"bench.log has no {expected!r}"
