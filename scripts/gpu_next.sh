#!/bin/bash
# For the next session's first GPU call (~9 min): what session 3 could not run.
# 1. bench --generate: the same-run transformers ratios of the index_copy_ decode step (issue #5).
# 2. the decode variants never timed: max-autotune GEMMs with fused epilogues, CUDA graphs without trees.
# 3. the full dense table with every peer (issue #3), after the session-3 changes.
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
stamp generate; timeout 200 python3 -m fastppl bench --generate --batch-sizes 1,64 --new-tokens 128 --json $OUT/bench_generate.json 2>&1 | grep -v -i warn | tail -9
stamp decode; DECODE_BUDGET_S=170 DECODE_ONLY="index_copy (default),no cudagraph trees,max_autotune_gemm" timeout 200 python3 scripts/gpu_decode_variants.py > $OUT/decode.log 2>&1; echo "rc $?"; grep -v -i warn $OUT/decode.log | tail -9
stamp dense; timeout 150 python3 -m fastppl bench --model random:gpt2 --tokens 2097152 --naive-tokens 262144 --quiet --json $OUT/bench_gpt2.json 2>&1 | tail -8
stamp done
