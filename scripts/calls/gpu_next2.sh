#!/bin/bash
# (Recorded as run: graph_steps, which it times, was measured no faster and removed in session 5;
# see docs/BENCHMARKS.md, Session 5.)
# Session 4, second call: decode steps captured several to a CUDA graph (DecodeOptions.graph_steps).
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
stamp tests; timeout 100 python3 -m pytest -q -x tests/test_generate.py tests/test_kv_cache.py 2>&1 | grep -E "passed|failed|Error|assert" | head -8
stamp decode; DECODE_BUDGET_S=150 DECODE_ONLY="index_copy (default),graph 16 steps,graph 64 steps" timeout 170 python3 scripts/gpu_decode_variants.py > $OUT/decode3.log 2>&1; echo "rc $?"; grep -v -i warn $OUT/decode3.log | grep -v "^{" | tail -9
stamp generate; FASTPPL_DECODE=graph_steps=16 timeout 170 python3 -m fastppl bench --generate --batch-sizes 1,64 --new-tokens 128 --json $OUT/bench_generate_graph16.json 2>&1 | grep -v -i warn | tail -9
stamp done
