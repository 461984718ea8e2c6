"""What the commands print where a figure has no meaning or a run stops: an interrupted --resume run says it can go
on, a generation with no timed decode step gives no rate, and a CPU bench of hours is refused at once."""
import math

import pytest

import fastppl.pipeline as pipeline
from fastppl.cli import main
from fastppl.generate import generation_summary


def test_an_interrupted_resumable_run_says_how_to_go_on(tmp_path, tokenizer_dir, shakespeare, monkeypatch, capsys):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(pipeline, "load_model", interrupt)
    args = ["eval", "--model", "random:gpt2-tiny", "--tokenizer", str(tokenizer_dir), "--data", str(shakespeare),
            "--device", "cpu", "--quiet"]
    assert main(args) == 130
    assert capsys.readouterr().err == "fastppl: interrupted\n"
    assert main(args + ["--resume", str(tmp_path / "ckpt")]) == 130
    assert capsys.readouterr().err == ("fastppl: interrupted; run the same command again to go on from the last "
                                       f"checkpoint in {tmp_path / 'ckpt'}\n")


def _generation(rate: float) -> dict:
    return dict(completions=[dict(prompt="O", completion=" Romeo", finished=False)], time_to_first_token_seconds=0.05,
                decode_tokens_per_second=rate, decode_steps=1, decode_step="eager",
                environment=dict(device_name="cpu"))


@pytest.mark.parametrize("rate, printed", [(math.nan, "decode n/a (no decode step timed)"),
                                           (0.4, "decode 0.40 tokens/s"), (1234.4, "decode 1,234 tokens/s")])
def test_a_generations_decode_rate_is_given_only_where_steps_were_timed(rate, printed):
    assert printed in generation_summary(_generation(rate))


@pytest.mark.parametrize("args", [["--model", "random:gpt2", "--rounds", "3"], ["--generate"]])
def test_a_cpu_bench_of_hours_is_refused_at_once(args, capsys, monkeypatch):
    # the refusal is a lower bound at this CPU's measured matmul rate: a fixed rate makes it the same on every CPU
    import fastppl.bench.dense as dense
    import fastppl.bench.timers as timers
    for module in (dense, timers):
        monkeypatch.setattr(module, "matmul_ceiling", lambda device: 50e9)
    assert main(["bench", "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastppl: error: this bench is at least ") and "minutes of products on this CPU" in err
    assert err.count("\n") == 1 and "random:gpt2-tiny" in err
