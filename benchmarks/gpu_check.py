"""One command that checks a GPU machine: `pytest -m gpu` in full, then the loss, scorer, end-to-end and divergence
benchmarks at short settings (each figure beside its peer from the same run), within a time budget, and one table.

    PYTHONPATH=src python benchmarks/gpu_check.py OUTDIR                 # on the GPU machine: about 8 minutes
    PYTHONPATH=src python benchmarks/gpu_check.py OUTDIR --quick         # tiny settings on the CPU, under a minute

OUTDIR receives at most six files, written as the check goes (a run killed at a time limit still leaves them):
failures.txt (each failing test's id the moment it fails, then any stage that failed or ran out of time),
pytest.log, bench.log (each benchmark's command and output), results.json and summary.md (the table, also printed
at the end). Each stage runs in a process of its own under a time limit: pytest gets what the benchmarks' limits
leave of --budget, and a test running longer than --test-timeout is interrupted (its traceback in pytest.log) so
that the others still run. A stage that fails or runs out of time is a row of the table that says so; the check
goes on. The speed-up column is how many times faster fastppl's figure is than its peer's (peer time / fastppl
time, or fastppl rate / peer rate), both measured in the same process. --quick runs the stages side by side
(timings mean nothing there); on a GPU they run one after the other.

This file is also the pytest plugin that records each test's outcome (`-p gpu_check`, active only when
FASTPPL_GPU_CHECK_EVENTS names a file)."""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import pytest
except ImportError:   # the script runs pytest in a process of its own; the hooks below need it only there
    pytest = None

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = Path(__file__).resolve().parent
SHARED_DATA = Path(os.environ.get("FASTPPL_SHARED_DATA", ROOT.parent / "shared" / "data"))
EVENTS_VARIABLE, FAILURES_VARIABLE, TIMEOUT_VARIABLE = ("FASTPPL_GPU_CHECK_EVENTS", "FASTPPL_GPU_CHECK_FAILURES",
                                                        "FASTPPL_GPU_CHECK_TEST_TIMEOUT")


# ------------------------------------------------------------------------------------- the pytest plugin

class TestTimedOut(Exception):
    """Raised inside a test that ran past --test-timeout."""


def _write_line(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as out:   # opened per line: a kill loses nothing written before it
        out.write(line + "\n")


def pytest_collection_finish(session) -> None:
    if os.environ.get(EVENTS_VARIABLE):
        _write_line(os.environ[EVENTS_VARIABLE], json.dumps({"collected": [item.nodeid for item in session.items]}))


def pytest_runtest_logstart(nodeid, location) -> None:
    if os.environ.get(EVENTS_VARIABLE):
        _write_line(os.environ[EVENTS_VARIABLE], json.dumps({"started": nodeid}))


def _interrupt(signal_number, frame) -> None:
    """SIGALRM in a test past --test-timeout: every thread's stack to the log, then TestTimedOut in the test (a
    sleep or a wait is interrupted; a kernel that never returns is left to the stage's time limit)."""
    sys.stderr.write("\ngpu_check: a test ran past --test-timeout; interrupting it\n")
    try:
        faulthandler.dump_traceback(all_threads=True)
    except (AttributeError, ValueError, OSError):   # a captured stderr without a file descriptor
        pass
    raise TestTimedOut(f"ran past {os.environ.get(TIMEOUT_VARIABLE)} s (--test-timeout)")


def _guarded(item):
    """Run one phase of a test (its fixtures' setup, or its call) under --test-timeout."""
    seconds = float(os.environ.get(TIMEOUT_VARIABLE) or 0)
    if seconds:
        previous = signal.signal(signal.SIGALRM, _interrupt)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        if seconds:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


if pytest is not None:
    pytest_runtest_setup = pytest.hookimpl(hookwrapper=True)(_guarded)
    pytest_runtest_call = pytest.hookimpl(hookwrapper=True)(_guarded)


def pytest_runtest_logreport(report) -> None:
    events, failures = os.environ.get(EVENTS_VARIABLE), os.environ.get(FAILURES_VARIABLE)
    if not events:
        return
    outcome = "xfailed" if hasattr(report, "wasxfail") else report.outcome
    _write_line(events, json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": outcome}))
    if report.failed and failures:
        kind = "FAILED" if report.when == "call" else f"ERROR at {report.when}"
        _write_line(failures, f"{kind} {report.nodeid}")


# ------------------------------------------------------------------------------------- running stages

class Clock:
    """The check's budget: what is left of it."""

    def __init__(self, budget: float):
        self.deadline = time.monotonic() + budget
        self.started = time.monotonic()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started


def start(command: list[str], log: Path, env: dict):
    """command in a process of its own (a session: its children end with it), stdout and stderr to log."""
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"\n$ {' '.join(command)}\n")
    out = open(log, "a", encoding="utf-8")   # noqa: SIM115 (the child writes to it until it ends)
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                               start_new_session=True)
    process.log_file, process.started = out, time.monotonic()
    return process


def finish(process, limit: float) -> tuple[str, float]:
    """Wait at most `limit` seconds; ("ok" | "exit N" | "timeout after N s", seconds)."""
    limit = max(limit, 1.0)
    try:
        returncode = process.wait(timeout=max(limit - (time.monotonic() - process.started), 1.0))
        status = "ok" if returncode == 0 else f"exit {returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)   # the stage's own process group, children included
        process.wait()
        status = f"timeout after {limit:.0f} s"
    process.log_file.close()
    return status, time.monotonic() - process.started


def environment(env: dict, device: str) -> dict:
    """The device's name and the versions that matter, from a process of their own (the check's own process never
    creates a CUDA context)."""
    code = ("import json, importlib.metadata as m, torch\n"
            "def version(name):\n"
            "    try:\n        return m.version(name)\n    except m.PackageNotFoundError:\n        return None\n"
            f"cuda = torch.cuda.is_available() and {device!r} != 'cpu'\n"
            "print(json.dumps({'device': torch.cuda.get_device_name(0) if cuda else 'CPU', 'torch': torch.__version__,"
            " 'cuda': torch.version.cuda, 'triton': version('triton'), 'transformers': version('transformers'),"
            " 'gpus': torch.cuda.device_count() if cuda else 0}))")
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                              check=False)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except Exception as error:   # noqa: BLE001 (a machine that cannot even say its name is still checked)
        return {"device": f"unknown ({type(error).__name__})"}


# ------------------------------------------------------------------------------------- pytest

def start_pytest(args, outdir: Path, env: dict, scratch: Path):
    events = scratch / "pytest-events.jsonl"
    env = dict(env, **{EVENTS_VARIABLE: str(events), FAILURES_VARIABLE: str(outdir / "failures.txt"),
                       TIMEOUT_VARIABLE: str(args.test_timeout)})
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(BENCHMARKS)])   # last: for this plugin only
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-p", "gpu_check", "-rf",
               "-v", "--tb=short", *args.tests]
    process = start(command, outdir / "pytest.log", env)
    process.events = events
    return process


def test_counts(events: Path) -> tuple[dict[str, dict[str, int]], list[str], str | None]:
    """({test file: {passed, failed, error, skipped, not run}}, failed test ids, the test running when the stage
    ended, if one was)."""
    collected, phases, started = [], {}, []
    if events.exists():
        for line in events.read_text(encoding="utf-8").splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:   # a line cut short by a kill
                continue
            if "collected" in event:
                collected = event["collected"]
            elif "started" in event:
                started.append(event["started"])
            else:
                phases.setdefault(event["nodeid"], {})[event["when"]] = event["outcome"]
    files, failed = {}, []
    for nodeid in dict.fromkeys(collected + list(phases)):
        counts = files.setdefault(nodeid.split("::")[0], dict.fromkeys(
            ("passed", "failed", "error", "skipped", "not run"), 0))
        outcome = _test_outcome(phases.get(nodeid, {}))
        counts[outcome] += 1
        if outcome in ("failed", "error"):
            failed.append(nodeid)
    running = started[-1] if started and "teardown" not in phases.get(started[-1], {}) else None
    return files, failed, running


def _test_outcome(phases: dict[str, str]) -> str:
    if not phases:
        return "not run"
    if phases.get("call") == "failed":
        return "failed"
    if "failed" in phases.values():
        return "error"   # in setup or teardown
    if "skipped" in phases.values() or "xfailed" in phases.values():
        return "skipped"
    return "passed" if "call" in phases else "not run"


# ------------------------------------------------------------------------------------- benchmarks

def benchmark_commands(args, scratch: Path) -> dict[str, tuple[list[str], float]]:
    """{benchmark: (arguments, time limit in seconds)} at the check's short settings."""
    tokenizer, data = ["--tokenizer", args.tokenizer], args.data
    if args.quick:
        small = scratch / "corpus.txt"
        small.write_text(Path(args.data).read_text(encoding="utf-8")[:1500], encoding="utf-8")
        cpu = ["--device", "cpu"]
        return {
            "loss": ([*cpu, "--shapes", "tiny", "--rounds", "1", "--reps", "2"], 60),
            "scorer": ([*cpu, "--model", "gpt2-tiny", "--batch", "2", "--seq", "32", "--rounds", "1", "--batches",
                        "2", "--warmup", "1"], 60),
            "end_to_end": (["--model", "random:gpt2-tiny", *cpu, "--runs", "2", *tokenizer, "--data", str(small),
                            "--", "--ctx", "32"], 90),
            "divergence": (["--model", "gpt2-tiny", *cpu, "--ctx", "32", *tokenizer, "--data", str(small),
                            "--split", "all", "--logits-dir", str(scratch), "--no-warmup"], 90),
        }
    device = ["--device", args.device]
    return {
        "loss": ([*device, "--shapes", "gpt2,llama-1b", "--rounds", "3", "--reps", "5", "--no-compile"], 60),
        "scorer": ([*device, "--model", "gpt2", "--batch", "32", "--seq", "1024", "--variants",
                    "eager,eager-plain,chunked-eager", "--rounds", "2", "--batches", "5", "--warmup", "2"], 60),
        # the Llama family's fused trunk (eager, as eval runs) against the plain modules
        "scorer llama-1b": ([*device, "--model", "llama-1b", "--batch", "8", "--seq", "2048", "--variants",
                             "eager,eager-plain", "--rounds", "2", "--batches", "4", "--warmup", "1"], 70),
        "end_to_end": (["--model", "random:gpt2", *device, "--runs", "2", *tokenizer, "--data", data], 75),
        "divergence": (["--model", "gpt2", *device, "--ctx", "1024", *tokenizer, "--data", data,
                        "--logits-dir", str(scratch)], 100),
    }


def parse_tables(text: str) -> list[list[dict[str, str]]]:
    """Every Markdown table in text, as rows of {header: cell}."""
    tables, header, rows = [], None, []
    for line in text.splitlines() + [""]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            if header is not None:
                tables.append(rows)
            header, rows = None, []
        elif header is None:
            header = cells
        elif not all(set(c) <= set("-: ") for c in cells):
            rows.append(dict(zip(header, cells)))
    return tables


def _number(cell: str) -> float | None:
    match = re.match(r"[-+]?[\d,]*\.?\d+(?:e[-+]?\d+)?", cell.strip())
    return float(match.group(0).replace(",", "")) if match else None


def figures_of(name: str, output: str) -> list[dict]:
    """A benchmark's figures beside their peers: [{check, fastppl, peer, speedup}] (speedup > 1: fastppl faster)."""
    tables, figures = parse_tables(output), []

    def add(check, ours, ours_value, peer, peer_value, faster_is_lower):
        speedup = None
        if ours_value and peer_value:
            speedup = peer_value / ours_value if faster_is_lower else ours_value / peer_value
        figures.append({"check": check, "fastppl": ours, "fastppl_value": ours_value, "peer": peer,
                        "peer_value": peer_value, "speedup": speedup})

    if name == "loss" and tables:
        by_shape = {}
        for row in tables[0]:
            by_shape.setdefault(row["shape (N x C x V)"], {})[row["loss"]] = _number(row["ms"])
        for shape, losses in by_shape.items():
            ours = next((k for k in losses if k.startswith("fused")), next((k for k in losses if "eager" in k), None))
            peer = "F.cross_entropy, full logits"
            add(f"loss, {shape}: ms", f"{ours} {losses.get(ours)}", losses.get(ours), f"{peer} {losses.get(peer)}",
                losses.get(peer), True)
    elif name.startswith("scorer") and tables:
        rows = {r["variant"]: _number(r["tokens/s"]) for r in tables[0]}
        for peer in ("eager-plain", "chunked-eager")[:2 if name == "scorer" else 1]:
            add(f"{name}: tokens/s, eager (as eval runs) vs {peer}", f"eager {rows.get('eager')}", rows.get("eager"),
                f"{peer} {rows.get(peer, 'not run here')}", rows.get(peer), False)
    elif name == "end_to_end" and tables:
        runs = tables[0]
        warm, cold = runs[-1], runs[0]
        add("end to end: wall s of a warm run vs the cold first run", f"warm {warm['wall s (process start to exit)']}",
            _number(warm["wall s (process start to exit)"]), f"cold {cold['wall s (process start to exit)']}",
            _number(cold["wall s (process start to exit)"]), True)
    elif name == "divergence" and tables:
        rows = {r["variant"]: _number(r["tokens/s"]) for r in tables[0]}
        ours = "fastppl eval --reference-model"
        for peer in ("stored logits (two runs, fp16 on disk)", "fastppl eval (model alone)",
                     "fastppl eval --reference-model, FASTPPL_FUSED_DIVERGENCE=0"):
            if peer not in rows and "FUSED" in peer:   # CUDA only
                continue
            add(f"divergence: tokens/s, one pass vs {peer}", f"{rows.get(ours)}", rows.get(ours),
                f"{rows.get(peer)}", rows.get(peer), False)
    return figures


# ------------------------------------------------------------------------------------- the table

TABLE_HEADER = "| check | fastppl | peer (same run) | speed-up | status |"


def summary(env_info: dict, files: dict, running: str | None, pytest_status: str, benchmarks: dict,
            seconds: float) -> str:
    lines = [f"GPU check on {env_info.get('device')}: torch {env_info.get('torch')} (CUDA {env_info.get('cuda')}), "
             f"triton {env_info.get('triton')}, transformers {env_info.get('transformers')}; {seconds:.0f} s", "",
             TABLE_HEADER, "| --- | --- | --- | --- | --- |"]
    for path, counts in sorted(files.items()):
        bad = counts["failed"] + counts["error"]
        status = "FAILED" if bad else ("not all run" if counts["not run"] else "ok")
        result = ", ".join(f"{n} {kind}" for kind, n in counts.items() if n or kind in ("passed", "failed"))
        lines.append(f"| {path} | {result} |  |  | {status} |")
    totals = {kind: sum(c[kind] for c in files.values()) for kind in ("passed", "failed", "error", "skipped",
                                                                    "not run")}
    note = f"; ended while running {running}" if running else ""
    lines.append(f"| pytest -m gpu, all files | {', '.join(f'{n} {k}' for k, n in totals.items())} |  |  | "
                 f"{pytest_status}{note} |")
    for name, outcome in benchmarks.items():
        if not outcome["figures"]:
            lines.append(f"| {name} | no figures |  |  | {outcome['status']} |")
        for f in outcome["figures"]:
            speedup = "n/a" if f["speedup"] is None else f"{f['speedup']:.2f}x"
            lines.append(f"| {f['check']} | {f['fastppl']} | {f['peer']} | {speedup} | {outcome['status']} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir", help="where the check's files go (created; at most six files)")
    parser.add_argument("--quick", action="store_true", help="tiny settings on the CPU, under a minute")
    parser.add_argument("--budget", type=float, help="seconds for the whole check (default: 510, --quick 60)")
    parser.add_argument("--test-timeout", type=float, default=150, help="seconds a test may run (default: 150)")
    parser.add_argument("--device", default="auto", help="the benchmarks' device (default: auto)")
    parser.add_argument("--tests", nargs="*", default=["tests"], help="test paths for pytest -m gpu")
    parser.add_argument("--benchmarks", default="all",
                        help="comma-separated benchmarks to run (loss, scorer, 'scorer llama-1b', end_to_end, "
                             "divergence), all, or none: the whole budget for the tests (default: all)")
    parser.add_argument("--tokenizer", default=str(SHARED_DATA / "gpt2-tokenizer"))
    parser.add_argument("--data", default=str(SHARED_DATA / "tinyshakespeare.txt"))
    args = parser.parse_args(argv)
    if args.quick:
        args.device = "cpu"
    clock = Clock(args.budget or (60 if args.quick else 510))
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    for name in ("failures.txt", "pytest.log", "bench.log"):
        (outdir / name).write_text("", encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    if args.quick:
        env["CUDA_VISIBLE_DEVICES"] = ""   # the CPU, even on a GPU machine
    env_info = environment(env, args.device)
    with tempfile.TemporaryDirectory(prefix="fastppl-gpu-check-") as scratch:
        scratch = Path(scratch)
        # on the GPU one stage at a time, so that no two share the device: the benchmarks first, each under its
        # limit, then pytest with all that is left (most of it: the benchmarks rarely need their limits)
        pytest_process = start_pytest(args, outdir, env, scratch) if args.quick else None
        benchmarks = run_benchmarks(args, outdir, env, scratch, clock, env_info)
        if pytest_process is None:
            pytest_process = start_pytest(args, outdir, env, scratch)
        pytest_status, _ = finish(pytest_process, clock.left())
        files, failed, running = test_counts(pytest_process.events)
    if pytest_status != "ok":
        _write_line(str(outdir / "failures.txt"), f"PYTEST: {pytest_status}" +
                    (f", while running {running}" if running else ""))
    table = summary(env_info, files, running, pytest_status, benchmarks, clock.elapsed())
    (outdir / "summary.md").write_text(table, encoding="utf-8")
    (outdir / "results.json").write_text(json.dumps({
        "environment": env_info, "seconds": round(clock.elapsed(), 1), "pytest": {
            "status": pytest_status, "files": files, "failed": failed, "running_at_end": running},
        "benchmarks": benchmarks}, indent=1), encoding="utf-8")
    print(table)
    return 0 if pytest_status == "ok" and all(b["status"] == "ok" for b in benchmarks.values()) else 1


def run_benchmarks(args, outdir: Path, env: dict, scratch: Path, clock: Clock, env_info: dict) -> dict:
    """Each benchmark in turn under its time limit; summary.md rewritten after each (a kill leaves the ones done)."""
    benchmarks = {}
    chosen = args.benchmarks.split(",") if args.benchmarks not in ("all", "none") else args.benchmarks
    for name, (arguments, limit) in benchmark_commands(args, scratch).items():
        if chosen == "none" or (chosen != "all" and name not in chosen):
            continue
        script = BENCHMARKS / f"{name.split()[0]}.py"   # "scorer llama-1b": scorer.py on another model
        process = start([sys.executable, str(script), *arguments], outdir / "bench.log", env)
        status, seconds = finish(process, min(limit, max(clock.left(), 1.0)))
        output = _stage_output(outdir / "bench.log")
        benchmarks[name] = {"status": status, "seconds": round(seconds, 1), "figures": figures_of(name, output)}
        if status != "ok":
            _write_line(str(outdir / "failures.txt"), f"BENCHMARK {name}: {status} (bench.log)")
        (outdir / "summary.md").write_text(summary(env_info, {}, None, "not run yet", benchmarks, clock.elapsed()),
                                           encoding="utf-8")
    return benchmarks


def _stage_output(log: Path) -> str:
    """What the stage's process wrote to the shared log (the last command's section)."""
    text = log.read_text(encoding="utf-8", errors="replace")
    return text[text.rfind("\n$ "):]


if __name__ == "__main__":
    raise SystemExit(main())
