#!/bin/bash
# Session 9: the scored-rows gather (engine.score) on the GPU: the bitwise GPU test, the GPU suite, then the
# sliding-window speed with the gather on and off, then the documents bench (packed/bucketed/padded; compile is
# off there by auto, the run being too short to repay it).
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
stamp tests; timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -4
stamp gather; timeout 220 python3 scripts/gpu_gather.py 2>&1 | grep -v -i warn | tail -8
stamp docs; timeout 90 python3 -m fastppl bench --corpus docs --quiet --json $OUT/bench_docs.json 2>&1 | tail -8
stamp done
