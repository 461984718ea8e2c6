#!/bin/bash
# Session 14, call 1: the fused loss's (tile, k) loop nest flattened into one loop, against the committed kernel
# (as kernels); the residual adds moved into cuBLAS (scripts/gpu_residual_gemm.py); both against both before in
# `fastppl bench`; the GPU tests.
# Before the call, here: git show HEAD:src/fastppl/engine/fused_loss.py > .devcache/old_fused_loss.py, and
# git show HEAD:src/fastppl/accel/fused_norm.py > .devcache/old_fused_norm.py (both at 020d1b6)
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA
export OLD_FUSED_LOSS=$PWD/.devcache/old_fused_loss.py OLD_FUSED_NORM=$PWD/.devcache/old_fused_norm.py
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv,noheader
timeout 100 python3 scripts/gpu_loss_compare.py > $OUT/loss_compare.log 2>&1; echo "loss_compare rc $?"
BENCH="bench --model random:gpt2 --tokens 2097152 --quiet"
OLD_LOSS_BENCH="import importlib.util, os, sys
s = importlib.util.spec_from_file_location('o', os.environ['OLD_FUSED_LOSS']); o = importlib.util.module_from_spec(s); s.loader.exec_module(o)
import fastppl.engine.fused_loss as f; f.fused_token_nll = o.fused_token_nll
s = importlib.util.spec_from_file_location('fastppl.accel._old_fused_norm', os.environ['OLD_FUSED_NORM']); n = importlib.util.module_from_spec(s); s.loader.exec_module(n)
import fastppl.accel.fused_norm as fn; fn._fused_forward = n._fused_forward
from fastppl.cli import run; run()"
timeout 130 python3 -m fastppl $BENCH --peers hf-compiled,fastppl --json $OUT/bench_new.json > $OUT/bench_new.log 2>&1; echo "bench new rc $?"
timeout 60 python3 -c "$OLD_LOSS_BENCH" $BENCH --peers fastppl --json $OUT/bench_old.json > $OUT/bench_old.log 2>&1; echo "bench old rc $?"
timeout 90 python3 scripts/gpu_residual_gemm.py > $OUT/residual.log 2>&1; echo "residual rc $?"
timeout 120 python3 -m pytest -q -m gpu tests/test_fused_loss.py tests/test_fused_norm.py tests/test_gpu.py 2>&1 | tail -3
tail -9 $OUT/loss_compare.log
for f in new old; do echo "== bench $f"; grep -E "^\|" $OUT/bench_$f.log | tail -3; done
tail -4 $OUT/residual.log
