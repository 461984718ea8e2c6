"""The run's start: the corpus is tokenized on a thread of its own while the weights load (and, on CUDA, while the
context starts), with the same result as one after the other, the errors of each reported as before, and
stage_seconds that show what overlapped."""
import threading
import time

import pytest
import torch

import fastppl.pipeline as pipeline
from fastppl.config import EvalConfig
from fastppl.errors import FastpplError
from fastppl.pipeline import evaluate

MAIN_THREAD_STAGES = ("read_corpus", "load_tokenizer", "load_model", "wait_for_tokenize", "prepare",
                      "wait_for_warm_up", "choose_batch_size", "scoring")


def _run(tokenizer_dir, paths, **overrides):
    config = dict(model="random:gpt2-tiny", data=[str(p) for p in paths], tokenizer=str(tokenizer_dir), ctx=32,
                  device="cpu", dtype="fp32", quiet=True)
    return evaluate(EvalConfig(**{**config, **overrides}))


@pytest.fixture
def texts(tmp_path, shakespeare):
    corpus = shakespeare.read_text()
    paths = [tmp_path / f"part{i}.txt" for i in range(3)]
    for i, path in enumerate(paths):
        path.write_text(corpus[i * 5000:(i + 1) * 5000])   # above the token cache's smallest entry
    return paths


class _InForeground:
    """pipeline.InBackground run at once on the caller's thread: the order of one stage after the other."""

    def __init__(self, fn, name):
        started = time.perf_counter()
        self._value = fn()
        self.seconds = time.perf_counter() - started

    def result(self):
        return self._value


@pytest.mark.parametrize("cache", ["cold", pytest.param("warm", marks=pytest.mark.slow)])
def test_tokenizing_beside_loading_gives_the_result_of_one_after_the_other(tokenizer_dir, texts, monkeypatch,
                                                                            tmp_path, cache):
    monkeypatch.setenv("FASTPPL_CACHE_DIR", str(tmp_path / cache))
    if cache == "warm":
        _run(tokenizer_dir, texts)
    overlapped = _run(tokenizer_dir, texts, per_token=str(tmp_path / "overlapped.npy"))   # no file: in the result
    monkeypatch.setattr(pipeline, "InBackground", _InForeground)
    monkeypatch.setenv("FASTPPL_CACHE_DIR", str(tmp_path / f"{cache}-sequential"))
    if cache == "warm":
        _run(tokenizer_dir, texts)
    sequential = _run(tokenizer_dir, texts, per_token=str(tmp_path / "sequential.npy"))
    for key in ("nll_sum", "tokens_scored", "bytes", "corpus_sha256", "windows"):
        assert overlapped[key] == sequential[key], key
    assert overlapped.per_token.tobytes() == sequential.per_token.tobytes()


@pytest.mark.slow
def test_tokenizing_runs_while_the_model_loads(tokenizer_dir, texts, monkeypatch):
    """load_model waits for the tokenizer to have started: one after the other, it would wait in vain."""
    tokenizing, real_encode, real_load = threading.Event(), pipeline.encode_documents, pipeline.load_model

    def encode(*args, **kwargs):
        tokenizing.set()
        time.sleep(0.9)   # one call for the corpus's texts
        return real_encode(*args, **kwargs)

    def load(*args, **kwargs):
        assert tokenizing.wait(timeout=20), "the corpus was not being tokenized while the model loaded"
        time.sleep(0.6)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(pipeline, "encode_documents", encode)
    monkeypatch.setattr(pipeline, "load_model", load)
    stages = _run(tokenizer_dir, texts)["stage_seconds"]
    assert stages["tokenize"] >= 0.9 and stages["load_model"] >= 0.6   # each stage's own wall time
    # the main thread waited only for what tokenizing had left after the load
    assert stages["load_model"] + stages["wait_for_tokenize"] < stages["load_model"] + stages["tokenize"] - 0.2


@pytest.mark.slow
def test_the_main_threads_stages_add_up_to_the_wall_time(tokenizer_dir, texts):
    result = _run(tokenizer_dir, texts)
    stages = result["stage_seconds"]
    assert set(MAIN_THREAD_STAGES) | {"tokenize"} == set(stages)   # no CUDA start on the CPU
    assert sum(stages[s] for s in MAIN_THREAD_STAGES) == pytest.approx(result["wall_seconds"], abs=0.05)


@pytest.mark.slow
def test_the_cuda_start_is_reported_with_its_own_wall_time(tokenizer_dir, texts, monkeypatch):
    """The warm-up thread's own seconds, as it keeps them (a fixed figure here: the test checks where it goes, not
    how long anything takes)."""
    def warm_up(device):
        thread = threading.Thread(target=lambda: None)
        thread.seconds = 0.4375
        thread.start()
        return [thread]

    monkeypatch.setattr(pipeline, "start_cuda_warm_up", warm_up)
    stages = _run(tokenizer_dir, texts)["stage_seconds"]
    assert stages["cuda_start"] == 0.4375


def test_a_timed_thread_keeps_how_long_its_target_ran():
    from fastppl.accel.warm_up import _TimedThread
    thread = _TimedThread(target=time.sleep, args=(0.05,))
    assert thread.seconds is None
    thread.start()
    thread.join()
    assert thread.seconds >= 0.05   # sleep waits at least that long; no upper bound on a busy machine


def test_a_model_error_is_reported_without_waiting_for_the_tokenizer(tokenizer_dir, texts, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(pipeline, "encode_documents", lambda *a, **k: release.wait(timeout=60))

    def broken(*args, **kwargs):
        raise FastpplError("model.safetensors: cannot be read")

    monkeypatch.setattr(pipeline, "load_model", broken)
    started = time.perf_counter()
    with pytest.raises(FastpplError, match="cannot be read"):
        _run(tokenizer_dir, texts)
    assert time.perf_counter() - started < 10
    release.set()


def test_a_tokenizing_error_is_raised_on_the_callers_thread_after_the_models_checks(tokenizer_dir, texts,
                                                                                    monkeypatch):
    def unreadable(*args, **kwargs):
        raise FastpplError("part1.txt: cannot be tokenized")

    monkeypatch.setattr(pipeline, "encode_documents", unreadable)
    with pytest.raises(FastpplError, match="part1.txt: cannot be tokenized"):
        _run(tokenizer_dir, texts)
    # the model's own errors come first, as when the corpus was tokenized after the model loaded
    with pytest.raises(FastpplError, match="--ctx 4096 exceeds the model's maximum"):
        _run(tokenizer_dir, texts, ctx=4096)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_on_cuda_a_checkpoint_loaded_straight_to_the_gpu_beside_tokenizing_gives_the_same_sums(
        tokenizer_dir, texts, monkeypatch, tmp_path, dtype):
    from fastppl.models.loading import random_gpt2, save_hf_gpt2
    save_hf_gpt2(random_gpt2("gpt2-tiny", 3), tmp_path / "model")
    overrides = dict(model=str(tmp_path / "model"), device="cuda", dtype=dtype, compile="off", batch_size=4)
    overlapped = _run(tokenizer_dir, texts, **overrides)
    assert overlapped["stage_seconds"]["cuda_start"] > 0
    real_load = pipeline.load_model
    # one stage after the other, the weights read on the CPU and moved to the GPU by pipeline.accelerate
    monkeypatch.setattr(pipeline, "InBackground", _InForeground)
    monkeypatch.setattr(pipeline, "load_model", lambda *args: real_load(*args[:4], "cpu"))
    sequential = _run(tokenizer_dir, texts, **overrides)
    assert overlapped["nll_sum"] == sequential["nll_sum"] and overlapped["tokens_scored"] == sequential["tokens_scored"]


@pytest.mark.slow
def test_the_command_reports_the_process_start_before_evaluate(tokenizer_dir, texts, tmp_path):
    import json
    from fastppl.cli import main
    report = tmp_path / "report.json"
    assert main(["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--data", str(texts[0]),
                 "--ctx", "32", "--device", "cpu", "--quiet", "--json", str(report)]) == 0
    stages = json.loads(report.read_text())["stage_seconds"]
    assert stages["start_up"] > 0 and set(MAIN_THREAD_STAGES) <= set(stages)


@pytest.mark.slow   # a process of its own
def test_the_process_age_counts_from_the_interpreters_start():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.6); "
                           "from fastppl.report.result import seconds_since_process_start as s; print(s())"],
                          capture_output=True, text=True, timeout=120)
    assert 0.55 <= float(done.stdout) < 60
