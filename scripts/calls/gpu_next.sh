#!/bin/bash
# A record of the call as run: the Triton attention (its test file and "triton attention" variant) was measured
# slower there and removed afterwards, so steps 0 and that variant no longer find anything to run.
# Session 4's first GPU call (~9.5 min): the Triton decode attention checked, then what session 3 could not run.
# 0. GPU tests of the Triton decode-step attention (tests/test_decode_attention.py).
# 1. bench --generate: the same-run transformers ratios of the index_copy_ decode step (issue #5).
# 2. decode variants: the Triton attention, Inductor's reduction attention, max-autotune GEMMs.
# 3. what the default step's kernels are, per step (scripts/gpu_decode_probe.py).
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
stamp tests; timeout 70 python3 -m pytest -q -x tests/test_decode_attention.py 2>&1 | tail -4
stamp generate; timeout 180 python3 -m fastppl bench --generate --batch-sizes 1,64 --new-tokens 128 --json $OUT/bench_generate.json 2>&1 | grep -v -i warn | tail -9
stamp decode; DECODE_BUDGET_S=200 DECODE_ONLY="index_copy (default),triton attention,reduction attention,max_autotune_gemm" timeout 230 python3 scripts/gpu_decode_variants.py > $OUT/decode.log 2>&1; echo "rc $?"; grep -v -i warn $OUT/decode.log | tail -14
stamp probe; timeout 90 python3 scripts/gpu_decode_probe.py > $OUT/probe.log 2>&1; grep -v -i warn $OUT/probe.log | tail -46
stamp done
