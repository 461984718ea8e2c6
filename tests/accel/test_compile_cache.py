"""The compile cache (fastppl.accel.compile_cache): a damaged or stale artifacts file costs one warning line and a
recompile, never a crash or a wrong result; a warm cache lowers --compile auto's threshold; on the GPU a second
process compiles from the cache, faster, to the same NLL bit for bit."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fastppl.accel import compile_cache
from fastppl.accel.compile import COMPILE_MIN_TOKENS, WARM_COMPILE_SHARE, compile_score_fn, finish_compiled_run, \
    use_compile
from fastppl.engine.score import make_score_fn

ROOT = Path(__file__).resolve().parents[2]


class Tiny(nn.Module):
    """The smallest scorer input: an embedding and an output projection (a few kernels to compile)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.lm_head = nn.Linear(8, 50, bias=False)

    def forward(self, input_ids):
        return self.embed(input_ids)


def _valid_header(payload: bytes) -> bytes:
    return compile_cache.FORMAT + hashlib.sha256(payload).hexdigest().encode() + payload


@pytest.mark.parametrize("contents, why", [
    (b"\x00\x01 not an artifacts file", "not a fastppl artifacts file"),
    (compile_cache.FORMAT + b"0" * 64 + b"payload", "do not match their digest"),
    (_valid_header(b"bytes torch cannot read"), "torch could not read it"),
], ids=["not-an-artifacts-file", "digest-mismatch", "torch-refuses"])
def test_a_damaged_artifacts_file_is_one_warning_line_and_removed(contents, why, capfd):
    key = "tiny-chunked-0123"
    path = compile_cache.artifacts_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(contents)
    assert compile_cache.has_artifacts(key)
    assert compile_cache.load_artifacts(key) == "damaged"
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fastppl: warning: ignoring the compile cache") and why in err
    assert not path.exists() and compile_cache.load_artifacts(key) == "none"


def test_the_key_names_model_shape_dtype_loss_and_device():
    tiny, other, wider = Tiny(), Tiny(), Tiny()
    wider.lm_head = nn.Linear(8, 60, bias=False)
    assert compile_cache.cache_key(tiny, "chunked") == compile_cache.cache_key(other, "chunked")   # weights aside
    keys = {compile_cache.cache_key(tiny, "chunked"), compile_cache.cache_key(tiny, "fused"),
            compile_cache.cache_key(wider, "chunked"), compile_cache.cache_key(tiny, "divergence", wider),
            compile_cache.cache_key(other.to(torch.bfloat16), "chunked")}
    assert len(keys) == 5


def test_a_warm_cache_lowers_the_auto_threshold_to_its_share():
    cuda = torch.device("cuda")
    cold = COMPILE_MIN_TOKENS["llama", "chunked"]
    warm = int(cold * WARM_COMPILE_SHARE)
    assert use_compile("auto", cuda, warm, "chunked", "llama")[0] is False
    on, reason = use_compile("auto", cuda, warm, "chunked", "llama", warm_cache=True)
    assert on is True and reason == "on (auto with the warm compile cache)"
    off, reason = use_compile("auto", cuda, warm - 1, "chunked", "llama", warm_cache=True)
    assert off is False and f"with the warm compile cache; it pays from {warm:,}" in reason


@pytest.mark.slow
def test_on_the_cpu_a_damaged_file_recompiles_to_the_eager_result_and_is_replaced(capfd):
    """torch.compile with Inductor on the CPU (a C++ compiler is needed): a damaged artifacts file under the
    scorer's key, then a compile that warns once, gives the eager NLL and writes a valid file."""
    torch.manual_seed(0)
    model = Tiny().eval()
    key = compile_cache.cache_key(model, "chunked")
    path = compile_cache.artifacts_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_valid_header(b"stale") + b"!")
    eager = make_score_fn(model, 64, "chunked")
    compiled = compile_score_fn(make_score_fn(model, 64, "chunked"), key)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 16, dtype=torch.bool)
    with torch.inference_mode():
        got, expected = compiled(ids, ids, mask), eager(ids, ids, mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    stages = {}
    note = finish_compiled_run(compiled, stages)
    assert "its cache file damaged" in note and stages["compile"] > 0
    assert capfd.readouterr().err.count("fastppl: warning:") == 1
    assert compile_cache.load_artifacts(key) == "loaded"   # the new file, whole


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_the_gpu_a_second_process_compiles_from_the_cache_faster_to_the_same_nll(tmp_path, tokenizer_dir,
                                                                                   shakespeare):
    """Two `fastppl eval --compile on` processes sharing a fresh cache folder (the default loss: the fused kernel as
    a custom op inside the graph): the second's compile comes from the cache, takes less time than the first's,
    and its NLL sum is the first's bit for bit."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), FASTPPL_CACHE_DIR=str(tmp_path / "cache"),
               TRITON_CACHE_DIR=str(tmp_path / "triton"))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    reports = []
    for run in range(2):
        out = tmp_path / f"run{run}.json"
        done = subprocess.run([sys.executable, "-m", "fastppl", "eval", "--model", "random:gpt2-tiny", "--tokenizer",
                               str(tokenizer_dir), "--data", str(shakespeare), "--split", "val", "--device", "cuda",
                               "--ctx", "256", "--compile", "on", "--batch-size", "8", "--quiet", "--json", str(out)],
                              env=env, capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "fastppl: warning" not in done.stderr, done.stderr
        reports.append(json.loads(out.read_text()))
    first, second = reports
    assert "compiled afresh" in first["compile"] and "from the cache" in second["compile"], (first["compile"],
                                                                                              second["compile"])
    assert second["stage_seconds"]["compile"] < first["stage_seconds"]["compile"]
    assert second["nll_sum"] == first["nll_sum"]
