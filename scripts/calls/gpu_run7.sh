#!/bin/bash
# Session 2, call 2: the new kernels (fused loss target gather, fused residual norms): GPU tests, kernel
# timings, scorer profile, and the dense bench.
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu.py -k "fused_loss or residual_norms or fast_path" 2>&1 | tail -4
timeout 120 python3 scripts/gpu_loss_variants.py 2>&1 | grep -v Warning | tail -13
timeout 60 python3 scripts/gpu_profile_scorer.py 2>&1 | tail -12
FUSED_NORMS=0 timeout 60 python3 scripts/gpu_profile_scorer.py 2>&1 | grep "GPU time per batch"
timeout 200 python3 -m fastppl bench --model random:gpt2 --tokens 2097152 --naive-tokens 262144 --json $OUT/bench_gpt2.json 2>&1 | tail -8
