"""Bad inputs through the real entry point (`python -m fastppl`, real stderr), and the errors the command's
handler turns into one line: out of memory, a reader of stdout that leaves early, a hub out of reach."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from cli_errors import (
    ROOT,
    TINY,
    _args,
    _assert_user_error,
    _copy_checkpoint,
    _main,
    _subprocess,
)


@pytest.mark.slow   # a process of its own
def test_subprocess_missing_file(tmp_path, outputs, tokenizer_dir):
    proc = _subprocess(_args(TINY, tmp_path / "nope.txt", outputs, tokenizer_dir))
    _assert_user_error(proc.returncode, proc.stderr, outputs, "nope.txt: no such file")
    assert proc.stdout == ""


@pytest.mark.slow   # a process of its own
def test_subprocess_transformers_warnings_stay_off_stderr(tmp_path, checkpoint, text, outputs):
    """A config whose special ids lie outside its vocabulary made transformers log two warnings while the
    tokenizer was looked for, above fastppl's one error line (capsys does not see transformers' logger)."""
    model = _copy_checkpoint(checkpoint, tmp_path / "ids-outside")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(config, bos_token_id=50256, eos_token_id=50256)))
    proc = _subprocess(["eval", "--model", str(model), "--data", str(text), "--device", "cpu", "--quiet",
                        "--json", str(outputs[0])])
    _assert_user_error(proc.returncode, proc.stderr, outputs, "holds no tokenizer vocabulary")


@pytest.mark.slow   # a process of its own
def test_subprocess_truncated_checkpoint(tmp_path, checkpoint, text, outputs, tokenizer_dir):
    broken = _copy_checkpoint(checkpoint, tmp_path / "truncated")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    proc = _subprocess(_args(broken, text, outputs, tokenizer_dir))
    _assert_user_error(proc.returncode, proc.stderr, outputs, "model.safetensors", "corrupt or truncated")


@pytest.mark.slow   # a process of its own
def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path, text, tokenizer_dir):
    """`fastppl eval ... | head -1`: stdout's reader is gone before the summary is printed. Before, a
    BrokenPipeError traceback and exit 1; now the report is written, nothing is said, exit 141 (128 + SIGPIPE)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    report = tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "-m", "fastppl", "eval", "--model", TINY, "--data", str(text),
                             "--tokenizer", str(tokenizer_dir), "--device", "cpu", "--quiet", "--ctx", "16",
                             "--json", str(report)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()   # long before the summary: the process is still importing torch
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err
    assert json.loads(report.read_text())["tokens_scored"] > 0


def test_subprocess_help_and_usage():
    proc = _subprocess(["eval", "--help"])
    assert proc.returncode == 0 and proc.stderr == ""
    for flag in ("--model", "--data", "--window", "--ctx", "--stride", "--bos", "--json", "--per-token"):
        assert flag in proc.stdout
    proc = _subprocess([])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "see fastppl --help" in proc.stderr


@pytest.mark.parametrize("raised, size", [
    (lambda: torch.empty(500_000_000_000_000, dtype=torch.uint8), "465,661.29 GiB"),   # the CPU allocator's
    (lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity "
                                    "of 79.19 GiB of which 1.06 GiB is free."), "2.50 GiB"),
    (lambda: MemoryError("Unable to allocate 3.00 TiB for an array with shape (1, 2) and data type float64"),
     "3,072.00 GiB"),
], ids=["cpu", "cuda", "numpy"])
def test_out_of_memory_gives_the_size_in_gib_and_what_to_lower(monkeypatch, text, outputs, tokenizer_dir, capsys,
                                                              raised, size):
    """The message was torch's first line cut at 120 characters: "... you tried to allocate 51200000"."""
    def evaluate(config):
        error = raised()
        raise error
    monkeypatch.setattr("fastppl.pipeline.evaluate", evaluate)
    _assert_user_error(*_main(capsys, _args(TINY, text, outputs, tokenizer_dir)), outputs,
                       f"fastppl: error: out of memory (could not allocate {size}); lower --batch-size or --ctx, or "
                       "use a smaller model\n")


def test_json_path_with_a_trailing_slash_and_out_of_memory(tmp_path, tokenizer_dir, capsys, monkeypatch):
    rc, err = _main(capsys, ["generate", "--model", TINY, "--tokenizer", str(tokenizer_dir), "--device", "cpu",
                             "--prompt", "hi", "--max-new-tokens", "2", "--json", str(tmp_path / "sub") + "/"])
    assert rc == 2 and "is a directory; give a file path" in err and err.count("\n") == 1, err
    assert not (tmp_path / "sub").exists()     # not written as a file named sub
    monkeypatch.setattr("fastppl.bench.timers.CPU_BENCH_MINUTES", float("inf"))   # past the refusal of hours
    rc, err = _main(capsys, ["bench", "--generate", "--model", TINY, "--device", "cpu",
                             "--batch-sizes", str(10**11), "--new-tokens", "2"])
    # after bench's header line (progress): the error, one line, no traceback
    assert rc == 2 and err.splitlines()[-1].startswith("fastppl: error: out of memory") and "Traceback" not in err, err


@pytest.mark.slow   # a process of its own
def test_a_hub_id_with_the_hub_unreachable_fails_at_once_in_one_line(text, tokenizer_dir, tmp_path):
    """Online but with no route to the hub (here a closed local port): one request, not a retry loop that printed
    five warnings over 23 s before the error."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
               HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))
    for offline in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):   # either makes huggingface_hub offline
        env.pop(offline, None)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fastppl", "eval", "--model", "no-such-org/no-such-model",
                           "--tokenizer", str(tokenizer_dir), "--data", str(text), "--device", "cpu", "--quiet"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    # "unreachable", not "unknown": the hub did not say the model does not exist
    assert done.stderr.startswith("fastppl: error: model 'no-such-org/no-such-model': not a local directory, and "
                                  "the hub is unreachable")
    assert time.perf_counter() - started < 15

