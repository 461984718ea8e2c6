"""--compile auto: compile only when the run is long enough to repay it, by model family and loss."""
import torch

from fastppl.accel.compile import COMPILE_MIN_TOKENS, model_family, use_compile
from fastppl.models.loading import random_gpt2, random_native

CUDA = torch.device("cuda")   # use_compile only reads device.type; nothing runs on it


def test_explicit_settings_win():
    assert use_compile("on", torch.device("cpu"), 10)[0] is True
    assert use_compile("off", CUDA, 10**12, "chunked")[0] is False


def test_auto_is_off_on_cpu():
    assert use_compile("auto", torch.device("cpu"), 10**12, "chunked")[0] is False


def test_auto_threshold_depends_on_family_and_loss():
    llama = random_native("llama-tiny", 0, torch.device("cpu"))
    gpt2 = random_gpt2("gpt2-tiny", 0, torch.device("cpu"))
    assert model_family(llama) == "llama" and model_family(gpt2) == "gpt2"
    n = 20_000_000   # enough for a Llama with either loss and for GPT-2's chunked loss, not GPT-2's fused loss
    assert use_compile("auto", CUDA, n, "fused", "llama")[0] is True
    assert use_compile("auto", CUDA, n, "chunked", "gpt2")[0] is True
    on, reason = use_compile("auto", CUDA, n, "fused", "gpt2")
    assert on is False and f"{COMPILE_MIN_TOKENS['gpt2', 'fused']:,}" in reason
    assert use_compile("auto", CUDA, COMPILE_MIN_TOKENS["llama", "fused"] - 1, "fused", "llama")[0] is False


def test_auto_keeps_gpt2_sliding_windows_eager_with_the_fused_loss():
    """Sliding windows score a share of what they read; the eager fused scorer runs the loss on the scored
    positions only, which beats compiling for GPT-2 at any length (docs/BENCHMARKS.md, "Kernel-level figures behind
    the defaults")."""
    n = 10**12
    on, reason = use_compile("auto", CUDA, n, "fused", "gpt2", scored_share=0.5)
    assert on is False and "50.0 % of the positions read are scored" in reason
    assert use_compile("auto", CUDA, n, "fused", "gpt2", scored_share=1.0)[0] is True
    assert use_compile("auto", CUDA, n, "chunked", "gpt2", scored_share=0.5)[0] is True   # chunked never gathers
    assert use_compile("auto", CUDA, n, "fused", "llama", scored_share=0.5)[0] is True    # not measured: as before
    assert use_compile("on", CUDA, 10, "fused", "gpt2", scored_share=0.5)[0] is True
