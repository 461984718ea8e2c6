#!/bin/bash
# (Recorded as run: the variants it names other than the default, additive mask, bucket and MLP epilogue
# were measured slower and removed afterwards; see docs/BENCHMARKS.md, Session 5.)
# Session 5, third call: the batch-64 decode step's unaligned lm_head product (transposed_logits), the
# per-layer mask bias (additive_mask), FlexAttention, the MLP epilogue; a same-run bench --generate with the
# best; GPU tests of the compiled decode step; a batch-64 kernel profile if time is left.
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
stamp decode; DECODE_BUDGET_S=250 DECODE_ONLY="index_copy (default),transposed logits,additive + transposed logits,additive + transposed + bucket 64,flex attention,MLP epilogue,additive mask" timeout 270 python3 scripts/gpu_decode_variants.py > $OUT/decode5.log 2>&1; echo "rc $?"; grep -v -i warn $OUT/decode5.log | grep -v "^{" | tail -15
BEST=$(python3 scripts/best_decode_variant.py $OUT/decode_variants.json); echo "best: '$BEST'"
stamp generate; FASTPPL_DECODE="$BEST" timeout 100 python3 -m fastppl bench --generate --batch-sizes 1,64 --new-tokens 128 --json $OUT/bench_generate_best.json 2>&1 | grep -v -i warn | tail -9
stamp tests; timeout -s INT 80 python3 -m pytest -q tests/test_kv_cache.py tests/test_generate.py -k "cuda or (compiled_decode and 40)" 2>&1 | grep -E "passed|failed|Error|assert" | head -8
if [ $(( $(date +%s) - T0 )) -lt 480 ]; then
  stamp probe64; FASTPPL_DECODE="$BEST" PROBE_BATCH=64 timeout 60 python3 scripts/gpu_decode_probe.py > $OUT/probe64.log 2>&1; grep -E "^decode|total per step" $OUT/probe64.log
  grep -A 12 "us/step" $OUT/probe64.log | cut -c1-60,91-110
fi
stamp done
