#!/usr/bin/env bash
# Issue 5's same-run benchmarks on the GPU, one device call each (each fits in the 10-minute limit):
#   bash scripts/calls/gpu_bench_issue5.sh generate   # GPT-2 124M decode, batch 1 and 64: fastppl vs transformers
#   bash scripts/calls/gpu_bench_issue5.sh llama      # Llama-1B-shape scoring, B 8 x T 2048
#   bash scripts/calls/gpu_bench_issue5.sh test       # pytest -m gpu tests/test_bench_generate.py
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 FASTPPL_CACHE_DIR=/tmp/fastppl-cache
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
case "${1:-}" in
  generate)
    # perf_hints: a "skipping cudagraphs" line means a compiled decode step ran without its CUDA graph
    TORCH_LOGS=perf_hints timeout 570 python3 -m fastppl bench --generate --json $OUT/bench_generate.json \
      2> $OUT/bench_generate.log | tee $OUT/bench_generate.txt
    grep -i "skipping cudagraphs" $OUT/bench_generate.log | sort | uniq -c | head ;;
  llama)
    timeout 570 python3 -m fastppl bench --model random:llama-1b --json $OUT/bench_llama.json \
      2> $OUT/bench_llama.log | tee $OUT/bench_llama.txt ;;
  test)
    timeout 570 python3 -m pytest -q -m gpu tests/test_bench_generate.py 2>&1 | tail -5 | tee $OUT/pytest_gpu.log ;;
  *) echo "usage: $0 generate|llama|test" >&2; exit 2 ;;
esac
