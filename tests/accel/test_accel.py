"""CPU checks of the GPU fast path's machinery: out-of-memory back-off, compile on/off, bench."""
import json

import numpy as np
import pytest
import torch

from fastppl.cli import main
from fastppl.config import EvalConfig
from fastppl.data.batching import WindowRef, batch_from_plan
from fastppl.data.packing import plan_batches, split_rows
from fastppl.data.windows import chunked_windows
from fastppl.engine.score import GATHER_MULTIPLE, DeviceSums, make_score_fn, score_batches, score_plans
from fastppl.models.gpt2 import GPT2, GPT2Config
from fastppl.models.loading import random_gpt2
from fastppl.pipeline import evaluate


def _setup(n_tokens=700, ctx=32):
    model = random_gpt2("gpt2-tiny").eval()
    ids = np.random.default_rng(1).integers(0, 50257, n_tokens + 1)
    refs = [WindowRef(0, w) for w in chunked_windows(n_tokens, ctx)]
    build = lambda plan: batch_from_plan(plan, refs, [ids], [0])  # noqa: E731
    return model, refs, build, ctx


def _score(score_fn, refs, build, ctx, batch_size, n_tokens=700):
    sums = DeviceSums.zeros(ctx, torch.device("cpu"), n_tokens)
    plans = plan_batches([r.window.length for r in refs], "padded", ctx, batch_size)
    used = score_plans(score_fn, plans, build, sums, torch.device("cpu"), split=split_rows)
    return sums, used


def test_out_of_memory_back_off_loses_and_double_counts_nothing():
    model, refs, batch_of, ctx = _setup()
    plain = make_score_fn(model)
    calls = []

    def flaky(input_ids, targets, mask):      # "out of memory" above 4 rows, and once more at 4 rows
        calls.append(input_ids.shape[0])
        if input_ids.shape[0] > 4 or (input_ids.shape[0] == 4 and calls.count(4) == 2):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return plain(input_ids, targets, mask)

    reference, _ = _score(plain, refs, batch_of, ctx, batch_size=len(refs))
    sums, used = _score(flaky, refs, batch_of, ctx, batch_size=16)
    assert used == 2 and 16 in calls and 8 in calls
    assert sums.nll_sum.item() == pytest.approx(reference.nll_sum.item(), rel=1e-6)
    assert sums.position_count.sum().item() == 700           # every token counted once
    assert not torch.isnan(sums.per_token[:-1]).any()


def test_a_failing_on_batch_hook_is_not_taken_for_the_batch_running_out_of_memory():
    """The hook runs after the batch's sums are added: had its error been taken for the batch's out of memory,
    the batch would be scored again and counted twice."""
    model, refs, batch_of, ctx = _setup()
    sums = DeviceSums.zeros(ctx, torch.device("cpu"), 700)
    plans = plan_batches([r.window.length for r in refs], "padded", ctx, 8)

    def hook(batch):
        raise torch.OutOfMemoryError("CUDA out of memory (in a checkpoint's host copy)")
    with pytest.raises(torch.OutOfMemoryError):
        score_plans(make_score_fn(model), plans, batch_of, sums, torch.device("cpu"), on_batch=hook,
                    split=split_rows)
    assert sums.position_count.sum().item() == batch_of(plans[0]).n_scored   # the first batch, once


def test_the_report_says_when_batches_were_cut_for_memory(monkeypatch, tmp_path, tokenizer_dir):
    import fastppl.engine.score as score
    real_score_batches = score.score_batches

    def flaky(score_fn, batches, *args, **kwargs):
        batches = list(batches)
        if batches[0].input_ids.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_score_batches(score_fn, batches, *args, **kwargs)
    monkeypatch.setattr(score, "score_batches", flaky)
    text = tmp_path / "t.txt"
    text.write_text("Now is the winter of our discontent made glorious summer by this sun of York. " * 8)
    config = dict(model="random:gpt2-tiny", data=[str(text)], tokenizer=str(tokenizer_dir), ctx=32, device="cpu",
                  quiet=True)
    cut = evaluate(EvalConfig(**config, batch_size=8))
    assert cut["batch_size_reason"] == "--batch-size; out of memory at it, later batches ran 2 rows"
    monkeypatch.setattr(score, "score_batches", real_score_batches)
    whole = evaluate(EvalConfig(**config, batch_size=8))
    assert whole["batch_size_reason"] == "--batch-size" and cut["nll_sum"] == pytest.approx(whole["nll_sum"], rel=1e-9)


def test_other_errors_are_not_swallowed():
    model, refs, batch_of, ctx = _setup()

    def broken(*args):
        raise RuntimeError("shape mismatch")
    with pytest.raises(RuntimeError, match="shape mismatch"):
        _score(broken, refs, batch_of, ctx, batch_size=8)


@pytest.mark.slow   # torch.compile on the CPU
def test_compile_on_and_off_give_the_same_result(tmp_path, tokenizer_dir):
    text = tmp_path / "t.txt"
    text.write_text("Now is the winter of our discontent made glorious summer by this sun of York. " * 8)
    base = dict(model="random:gpt2-tiny", data=[str(text)], tokenizer=str(tokenizer_dir), ctx=64,
                device="cpu", batch_size=4, quiet=True)
    off = evaluate(EvalConfig(**base, compile="off"))
    on = evaluate(EvalConfig(**base, compile="on"))
    assert on["compile"].startswith("on") and off["compile"].startswith("off")
    assert on["nll_sum"] == pytest.approx(off["nll_sum"], rel=1e-5)


@pytest.mark.slow   # every peer of the bench on the CPU
def test_bench_cpu_path(tmp_path, capsys, sharpened_random_models):
    """Every peer's NLL against a direct fp32 computation with transformers on the bench's own rows: fastppl
    over all T targets of each row, the labels= peers over the T - 1 they score (fp32 on the CPU, autocast bf16)."""
    from hf_reference import hf_reference_nll
    out = tmp_path / "bench.json"
    rc = main(["bench", "--model", "random:gpt2-tiny", "--tokens", "1024", "--seq", "32", "--batch-size", "4",
               "--device", "cpu", "--json", str(out), "--quiet",
               # hf-compiled is hf-bf16 under torch.compile: a minute of CPU compile for no extra coverage
               "--peers", "naive,autocast,hf-bf16,fastppl"])
    assert rc == 0
    report = json.loads(out.read_text())
    names = [r["name"] for r in report["rows"]]
    assert names == ["naive", "autocast", "hf-bf16", "fastppl"]
    model = sharpened_random_models("gpt2-tiny")
    rows = np.random.default_rng(0).integers(0, model.vocab_size, size=(32, 33), dtype=np.int64)   # the bench's
    nll = hf_reference_nll(model, torch.from_numpy(rows))
    assert nll.std().item() > 0.3                              # far from uniform predictions
    naive, autocast, hf, fastppl = (r["nll"] for r in report["rows"])
    assert fastppl == pytest.approx(nll.mean().item(), rel=1e-5)
    assert naive == pytest.approx(nll[:, :31].mean().item(), rel=1e-5)
    assert hf == pytest.approx(nll[:, :31].mean().item(), rel=1e-5)
    assert autocast == pytest.approx(nll[:, :31].mean().item(), abs=5e-2)   # bf16 products
    assert all(r["tokens_per_second"] > 0 for r in report["rows"])
    assert report["rows"][-1]["compile"] == "off (auto: CPU)"
    assert "fastppl" in capsys.readouterr().out


def _bench_report(rates: dict, ceiling: float, peak: int) -> dict:
    """A one-round bench report with the given {peer: tokens/s}; fastppl's ratio against each when it ran."""
    fast = rates.get("fastppl")
    rows = [{"name": name, "tokens": 1000, "seconds": 1000 / rate, "tokens_per_second": rate,
             "share_of_ceiling": rate * 2 / ceiling, "nll": 10.0,
             "peak_memory_bytes": None if name == "fastppl" else peak,
             "fastppl_speedup": fast / rate if fast else None, "note": f"{name}, warm-up 3.0 s"}
            for name, rate in rates.items()]
    return {"model": "random:x", "seq_len": 8, "batch_size": 2, "device_name": "cpu", "torch": "t",
            "matmul_ceiling_flops": ceiling, "flops_per_token": 2, "rows": rows}


def test_bench_rounds_merge_to_medians_and_the_median_of_each_rounds_own_ratio():
    from fastppl.bench.dense import format_table, merge_rounds
    # per-round ratios 1, 3, 2: their median is 2, while the ratio of the medians would be 150 / 50 = 3;
    # neither the medians nor the extremes are the first round's
    merged = merge_rounds([_bench_report({"hf-compiled": 200, "fastppl": 200}, 3e12, 7),
                           _bench_report({"hf-compiled": 50, "fastppl": 150}, 1e12, 5),
                           _bench_report({"hf-compiled": 50, "fastppl": 100}, 2e12, 6)])
    peer, fast = merged["rows"]
    assert merged["rounds"] == 3 and merged["matmul_ceiling_flops"] == 2e12
    assert merged["matmul_ceiling_rounds"] == [3e12, 1e12, 2e12]
    assert peer["tokens_per_second"] == 50 and fast["tokens_per_second"] == 150
    assert peer["tokens_per_second_rounds"] == [200, 50, 50] and peer["seconds"] == 20
    assert peer["fastppl_speedup"] == 2 and peer["fastppl_speedup_range"] == [1, 3]
    assert fast["fastppl_speedup"] == 1 and fast["fastppl_speedup_range"] == [1, 1]
    assert peer["share_of_ceiling"] == pytest.approx(50 * 2 / 2e12, rel=1e-12, abs=0)   # median rate / ceiling
    assert peer["peak_memory_bytes"] == 7 and fast["peak_memory_bytes"] is None
    assert peer["note"] == "hf-compiled, warm-up 3.0 s (round 1)"
    table = format_table(merged)
    assert "median of 3 rounds" in table.splitlines()[0]
    peer_line = next(line for line in table.splitlines() if line.startswith("hf-compiled"))
    fast_line = next(line for line in table.splitlines()[2:] if line.startswith("fastppl"))
    assert "1.00-3.00" in peer_line and "+0.0%/+300.0%" in peer_line, peer_line
    assert "-33.3%/+33.3%" in fast_line, fast_line


def test_bench_rounds_without_fastppl_or_with_a_rate_over_no_time():
    from fastppl.bench.dense import format_table, merge_rounds
    merged = merge_rounds([_bench_report({"naive": r}, 1e12, 1) for r in (30, 10, 20)])
    (naive,) = merged["rows"]
    assert naive["tokens_per_second"] == 20 and naive["fastppl_speedup"] is None
    assert naive["fastppl_speedup_range"] is None and "naive" in format_table(merged)
    # a NaN rate (no time) is left out of the median and the range, whichever round it is
    for order in ((float("nan"), 100, 200), (100, float("nan"), 200)):
        merged = merge_rounds([_bench_report({"hf-bf16": 100, "fastppl": r}, 1e12, 1) for r in order])
        peer = merged["rows"][0]
        assert peer["fastppl_speedup_range"] == [1.0, 2.0] and peer["fastppl_speedup"] == 1.5
        assert merged["rows"][1]["tokens_per_second"] == 150
        format_table(merged)


def test_bench_rounds_with_different_peers_are_refused():
    from fastppl.bench.dense import merge_rounds
    from fastppl.errors import FastpplError
    with pytest.raises(FastpplError, match="rounds ran different peers"):
        merge_rounds([_bench_report({"hf-bf16": 1, "fastppl": 2}, 1e12, 1), _bench_report({"fastppl": 2}, 1e12, 1)])


@pytest.mark.slow   # several bench rounds
def test_bench_rounds_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", "random:gpt2-tiny", "--tokens", "256", "--seq", "32", "--batch-size", "4",
                 "--device", "cpu", "--peers", "hf-bf16,fastppl", "--rounds", "2", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["rounds"] == 2 and len(report["matmul_ceiling_rounds"]) == 2
    assert [len(r["tokens_per_second_rounds"]) for r in report["rows"]] == [2, 2]
    hf, fast = report["rows"]
    assert hf["tokens_per_second"] == pytest.approx(np.median(hf["tokens_per_second_rounds"]))
    assert hf["fastppl_speedup_range"][0] <= hf["fastppl_speedup"] <= hf["fastppl_speedup_range"][1]
    assert "median of 2 rounds" in captured.out
    progress = captured.err.splitlines()
    assert any(line.startswith("round 1/2: fastppl") for line in progress)
    assert any(line.startswith("round 2/2: fastppl") for line in progress), captured.err
    single = tmp_path / "single.json"
    assert main(["bench", "--model", "random:gpt2-tiny", "--tokens", "256", "--seq", "32", "--batch-size", "4",
                 "--device", "cpu", "--peers", "fastppl", "--json", str(single), "--quiet"]) == 0
    one = json.loads(single.read_text())
    assert one["rounds"] == 1 and "tokens_per_second_rounds" not in one["rows"][0]
    assert one["rows"][0]["nll"] == pytest.approx(fast["nll"], rel=1e-6)   # the same rows each round


def test_bench_says_when_tokens_are_rounded_to_whole_batches(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", "random:gpt2-tiny", "--tokens", "200", "--seq", "32", "--batch-size", "4",
                 "--device", "cpu", "--peers", "fastppl", "--json", str(out)]) == 0
    assert "--tokens 200 runs as 128: whole batches of 4 rows of 32" in capsys.readouterr().err
    assert json.loads(out.read_text())["rows"][0]["tokens"] == 128


@pytest.mark.slow   # torch.compile on the CPU
def test_bench_compile_on_compiles_fastppls_row_and_agrees_with_eager(tmp_path, monkeypatch):
    import fastppl.accel.apply as compile_module   # where eval and bench compile
    compiled, real = [], compile_module.compile_score_fn
    monkeypatch.setattr(compile_module, "compile_score_fn", lambda fn, *key: compiled.append(fn) or real(fn, *key))
    reports = {}
    for setting in ("off", "on"):
        out = tmp_path / f"bench-{setting}.json"
        assert main(["bench", "--model", "random:gpt2-tiny", "--tokens", "256", "--seq", "32", "--batch-size", "4",
                     "--device", "cpu", "--peers", "fastppl", "--compile", setting, "--json", str(out), "--quiet"]) == 0
        reports[setting] = json.loads(out.read_text())["rows"][0]
    assert reports["on"]["compile"] == "on (--compile on)" and "compiled" in reports["on"]["note"]
    assert reports["off"]["compile"] == "off (--compile off)" and "eager" in reports["off"]["note"]
    assert len(compiled) == 1                    # the "on" run compiled, the "off" run did not
    assert reports["on"]["nll"] == pytest.approx(reports["off"]["nll"], rel=1e-5)


@pytest.mark.slow
def test_out_of_memory_after_the_forward_adds_nothing(monkeypatch):
    """An allocation that fails while the sums are updated (a copy of the per-document or per-token
    index) must leave every sum as it was, so that the retried batch is counted once."""
    import fastppl.engine.score as score_module
    model, refs, build, ctx = _setup()
    plain = make_score_fn(model)

    def run():
        sums = DeviceSums.zeros(ctx, torch.device("cpu"), 700, n_documents=1)
        plans = plan_batches([r.window.length for r in refs], "padded", ctx, 8)
        score_plans(plain, plans, build, sums, torch.device("cpu"), split=split_rows)
        return sums

    reference = run()
    real_to_device, calls = score_module.to_device, []

    def failing_once(array, device):
        calls.append(1)
        if len(calls) == 6:   # the 1st batch's index copies, after its inputs and its forward
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return real_to_device(array, device)

    monkeypatch.setattr(score_module, "to_device", failing_once)
    sums = run()
    assert len(calls) > 6
    assert sums.nll_sum.item() == pytest.approx(reference.nll_sum.item(), rel=1e-9)
    assert sums.position_count.sum().item() == reference.position_count.sum().item() == 700
    assert sums.per_document[:-1].sum().item() == pytest.approx(reference.per_document[:-1].sum().item(), rel=1e-9)


def test_balanced_batch_size_runs_fewest_padding_rows_in_as_many_batches():
    from fastppl.accel.batch_size import balanced_batch_size
    for rows in (1, 3, 8, 64, 256):
        for n in (1, 5, 9, 64, 65, 330, 1000, 4096):
            rows_here = min(rows, n)
            b = balanced_batch_size(rows_here, n)
            assert 1 <= b <= rows_here
            assert -(-n // b) == -(-n // rows_here)          # no more batches than before
            assert b < 8 or b % 8 == 0 or b == rows_here
    assert balanced_batch_size(256, 330) == 168
    assert balanced_batch_size(256, 4096) == 256


@pytest.mark.slow   # the fused loss in Triton's interpreter
def test_the_fused_scorer_runs_the_loss_on_the_scored_positions_only(monkeypatch):
    """Sliding windows score about half of what they read and padding rows nothing: with the fused loss
    (Triton's interpreter on CPU) only the scored positions reach the kernel, with the same NLL as the
    kernel run on every position."""
    pytest.importorskip("triton")
    import fastppl.engine.fused_loss as fused_loss
    from fastppl.data.batching import iter_batches
    from fastppl.data.windows import sliding_windows
    # gpt2-tiny's widths with a 1,000-entry vocabulary (the interpreter's time grows with it; 1,000 is a multiple
    # of no vocabulary tile, so the tail is masked)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=256, vocab_size=1000)
    model = GPT2(config)
    model.init_weights(torch.Generator().manual_seed(0))
    model.eval()
    ctx, stride, n_tokens = 64, 16, 160   # 7 windows: a batch of 5, then 2 and 3 padding rows
    stream = np.random.default_rng(2).integers(0, config.vocab_size, n_tokens)
    refs = [WindowRef(0, w) for w in sliding_windows(n_tokens, ctx, stride)]
    rows_in, real_kernel = [], fused_loss.fused_token_nll
    monkeypatch.setattr(fused_loss, "fused_token_nll",
                        lambda hidden, *args, **kwargs: rows_in.append(hidden.shape[0])
                        or real_kernel(hidden, *args, **kwargs))

    def run(score_fn):
        sums = DeviceSums.zeros(ctx, torch.device("cpu"), n_tokens)
        batches = list(iter_batches(refs, [stream], [1], 5, ctx))
        score_batches(score_fn, batches, sums, torch.device("cpu"))
        return sums, [b.n_scored for b in batches]

    fused = make_score_fn(model, loss="fused")
    gathered, n_scored = run(fused)
    # the scored rows, not 5 x ctx, in a whole number of GATHER_MULTIPLE (the last one repeated)
    assert rows_in == [-(-n // GATHER_MULTIPLE) * GATHER_MULTIPLE for n in n_scored]
    assert max(rows_in) < 5 * ctx
    rows_in.clear()
    every_position, _ = run(lambda *args: fused(*args))          # a wrapper that does not say it gathers
    assert rows_in == [5 * ctx] * len(n_scored)
    # a row's NLL does not depend on which rows share its launch. On a GPU the same bits (tests/test_gpu.py);
    # Triton's interpreter computes tl.dot with numpy, whose products may round a row's last bit by its block
    scored = ~torch.isnan(every_position.per_token)
    assert torch.equal(scored, ~torch.isnan(gathered.per_token))
    assert (gathered.per_token[scored] - every_position.per_token[scored]).abs().max().item() <= 2e-6
    assert gathered.nll_sum.item() == pytest.approx(every_position.nll_sum.item(), rel=1e-7)


def _never_probe(rows):
    raise AssertionError("the probe ran although the memory bound shows the largest batch fits")


def test_auto_batch_size_skips_the_probe_where_the_memory_bound_fits(monkeypatch):
    from fastppl.accel import batch_size
    model = random_gpt2("gpt2-tiny")
    bound = batch_size.scoring_memory_bound(model, 1024, 2, "chunked", 8192)
    monkeypatch.setattr(batch_size, "_free_bytes", lambda device: 4 * bound.total(batch_size.MAX_AUTO_BATCH))
    rows, reason = batch_size.auto_batch_size(_never_probe, 1000, torch.device("cuda"), bound=bound)
    assert rows == batch_size.MAX_AUTO_BATCH and "no probe" in reason
    rows, _ = batch_size.auto_batch_size(_never_probe, 123, torch.device("cuda"), bound=bound)
    assert rows == 123    # every window in one batch


def test_auto_batch_size_probes_where_the_memory_bound_does_not_fit(monkeypatch):
    from fastppl.accel import batch_size
    bound = batch_size.MemoryBound(per_row=1e9, fixed=0)
    probed = []
    monkeypatch.setattr(batch_size, "_free_bytes", lambda device: 40e9)
    monkeypatch.setattr(batch_size, "_measured_bytes_per_row",
                        lambda probe, rows, device: (probed.append(rows), 0.5e9)[1])
    rows, reason = batch_size.auto_batch_size(_never_probe, 1000, torch.device("cuda"), bound=bound)
    assert probed == [4] and reason == "auto: probed 4 rows"
    assert rows == 56     # 0.75 * 40 GB / 0.5 GB = 60 rows, cut to a multiple of 8
    probed.clear()
    rows, _ = batch_size.auto_batch_size(_never_probe, 1000, torch.device("cuda"), bound=None)
    assert probed == [4] and rows == 56


def test_auto_batch_size_halves_a_probe_that_runs_out_of_memory(monkeypatch):
    """A model so large that 4 probe rows do not fit: the probe halves (it failed the run before), and only a
    row that does not fit alone, or another error, ends the run."""
    from fastppl.accel import batch_size
    probed = []

    def measure(fits):
        def measured(probe, rows, device):
            probed.append(rows)
            if rows > fits:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return 10e9
        return measured
    monkeypatch.setattr(batch_size, "_free_bytes", lambda device: 40e9)
    monkeypatch.setattr(batch_size, "_measured_bytes_per_row", measure(fits=1))
    rows, reason = batch_size.auto_batch_size(_never_probe, 1000, torch.device("cuda"))
    assert probed == [4, 2, 1] and rows == 3 and reason == "auto: probed 1 rows (2 ran out of memory)"
    probed.clear()
    monkeypatch.setattr(batch_size, "_measured_bytes_per_row", measure(fits=0))
    with pytest.raises(torch.OutOfMemoryError):
        batch_size.auto_batch_size(_never_probe, 1000, torch.device("cuda"))
    assert probed == [4, 2, 1]

    def fails(probe, rows, device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(batch_size, "_measured_bytes_per_row", fails)
    with pytest.raises(RuntimeError, match="illegal memory access"):   # not taken for out of memory
        batch_size.auto_batch_size(_never_probe, 1000, torch.device("cuda"))


def test_memory_bound_covers_fastppl_models_only_and_grows_with_the_row_length():
    from fastppl.accel.batch_size import scoring_memory_bound
    from fastppl.models.loading import random_native
    gpt2, llama = random_gpt2("gpt2-tiny"), random_native("llama-tiny")
    for model in (gpt2, llama):
        short, long = (scoring_memory_bound(model, t, 2, "chunked", 8192) for t in (256, 1024))
        assert 4 * short.per_row < long.per_row and short.fixed == long.fixed > 0
        assert scoring_memory_bound(model, 1024, 2, "fused", 8192).fixed == 0
    assert scoring_memory_bound(torch.nn.Linear(4, 4), 1024, 2, "chunked", 8192) is None


def test_evaluate_waits_for_the_warm_up_before_the_first_kernel(monkeypatch, tmp_path, tokenizer_dir):
    import fastppl.engine.score as score
    import fastppl.pipeline as pipeline
    import fastppl.runner as runner
    events = []

    class Thread:
        def join(self):
            events.append("joined")

    real_score_batches = score.score_batches
    monkeypatch.setattr(pipeline, "start_cuda_warm_up", lambda device: [Thread()])
    monkeypatch.setattr(runner, "score_batches",
                        lambda *a, **k: (events.append("scored"), real_score_batches(*a, **k))[1])
    monkeypatch.setattr(runner, "score_plans",
                        lambda *a, **k: (events.append("scored"), score.score_plans(*a, **k))[1])
    text = tmp_path / "t.txt"
    text.write_text("Now is the winter of our discontent made glorious summer by this sun of York. " * 8)
    result = evaluate(EvalConfig(model="random:gpt2-tiny", data=[str(text)], tokenizer=str(tokenizer_dir), ctx=64,
                                 device="cpu", batch_size="auto", quiet=True))
    assert events[0] == "joined" and "scored" in events and "wait_for_warm_up" in result["stage_seconds"]


@pytest.mark.slow
def test_the_triton_warm_up_fills_the_kernel_cache_key_without_torch():
    # a fresh interpreter, as the CLI starts it: before `import torch`, and importing nothing on its thread
    import subprocess
    import sys
    pytest.importorskip("triton")
    code = ("import sys, fastppl.cli, fastppl.accel.warm_up as w; print('torch' in sys.modules); "
            "t = w.start_triton_warm_up(); print(t.daemon, w.start_triton_warm_up() is t); modules = set(sys.modules); "
            "t.join(); print(set(sys.modules) == modules, w._triton_key_function().cache_info().currsize)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "True", "True", "1"]
    from fastppl.accel.warm_up import start_cuda_warm_up
    assert start_cuda_warm_up(torch.device("cpu")) == []


def test_the_cli_starts_the_triton_warm_up_unless_on_the_cpu(monkeypatch, tmp_path):
    from fastppl.accel import warm_up
    started = []
    monkeypatch.setattr(warm_up, "start_triton_warm_up", lambda: started.append(1))
    monkeypatch.setattr("fastppl.pipeline.start_cuda_warm_up", lambda device: [])   # on a GPU machine too
    missing = str(tmp_path / "missing.txt")
    assert main(["eval", "--model", "random:gpt2-tiny", "--data", missing, "--device", "cpu"]) == 2
    assert started == []
    assert main(["eval", "--model", "random:gpt2-tiny", "--data", missing]) == 2
    assert started == [1]


def test_the_memory_bound_counts_rows_of_ctx_positions(monkeypatch, tmp_path, tokenizer_dir):
    # windows shorter than ctx still run in rows of ctx positions (padded): a bound for the longest window
    # would be far too low and skip the probe into an out-of-memory
    import fastppl.runner as runner
    lengths = []
    real = runner.scoring_memory_bound
    monkeypatch.setattr(runner, "scoring_memory_bound",
                        lambda model, seq_len, *a: (lengths.append(seq_len), real(model, seq_len, *a))[1])
    text = tmp_path / "t.txt"
    text.write_text("Now is the winter of our discontent.")
    evaluate(EvalConfig(model="random:gpt2-tiny", data=[str(text)], tokenizer=str(tokenizer_dir), ctx=64,
                        device="cpu", batch_size="auto", quiet=True))
    assert lengths == [64]
