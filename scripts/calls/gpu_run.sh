#!/usr/bin/env bash
# One device call: checks, loss timings, GPU tests, end-to-end eval timings. Results under $OUT.
# Needs the shared data copied into .devcache/data (carried): cp -r ../shared/data .devcache/
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 FASTPPL_CACHE_DIR=/tmp/fastppl-cache NCCL_NVLS_ENABLE=0
export FASTPPL_SHARED_DATA=$PWD/.devcache/data
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
D=.devcache/data
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv | tee $OUT/gpu.txt
python3 scripts/gpu_check.py 2>&1 | tee $OUT/check.log | tail -12
python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -5 | tee $OUT/pytest_gpu.log
EVAL="python3 -m fastppl eval --model random:gpt2 --tokenizer $D/gpt2-tokenizer --data $D/tinyshakespeare.txt --split all --quiet"
for run in cold-token-cache warm-token-cache; do
  /usr/bin/time -f "$run wall %e s" $EVAL --json $OUT/e2e-$run.json 2>&1 | tail -3
done
/usr/bin/time -f "compile-on cold wall %e s" $EVAL --compile on 2>&1 | tail -2
/usr/bin/time -f "compile-on warm-cache wall %e s" $EVAL --compile on 2>&1 | tail -2
/usr/bin/time -f "bf16 batch auto wall %e s" $EVAL --batch-size auto 2>&1 | tail -2
python3 - <<PY
import json
for r in ("cold-token-cache", "warm-token-cache"):
    d = json.load(open("$OUT/e2e-" + r + ".json"))
    print(r, "tokens", d["tokens_scored"], "wall", round(d["wall_seconds"], 2), "scoring", round(d["scoring_seconds"], 3),
          "tok/s", round(d["tokens_per_second"]), "peak GiB", round(d["peak_memory_bytes"] / 2**30, 2), d["compile"], d["loss"])
PY
