#!/bin/bash
# (Recorded as run: the stacked (2, B, nkv, L, hs) cache it measured made the two-write default copy the whole
# cache every step, 2.45 ms at batch 64, and was reverted, as was the split argmax it timed; see
# docs/BENCHMARKS.md, Session 5.)
# Session 5, second call: where the batch-64 decode step spends its time; FlexAttention's decoding kernel
# and the attend-length bucket as the decode step's attention, the stacked cache write; a same-run
# bench --generate with the best of them.
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
stamp tests; timeout 120 python3 -m pytest -q -x tests/test_generate.py tests/test_kv_cache.py 2>&1 | grep -E "passed|failed|Error|assert" | head -8
stamp probe64; PROBE_BATCH=64 timeout 90 python3 scripts/gpu_decode_probe.py > $OUT/probe64.log 2>&1; echo "rc $?"; grep -E "^decode|total per step" $OUT/probe64.log
grep -A 16 "us/step" $OUT/probe64.log | cut -c1-60,91-110
stamp decode; DECODE_BUDGET_S=250 DECODE_ONLY="index_copy (default),bucket 64,stacked cache write,split argmax,MLP epilogue,stacked + split argmax + MLP epilogue,flex attention" timeout 270 python3 scripts/gpu_decode_variants.py > $OUT/decode4.log 2>&1; echo "rc $?"; grep -v -i warn $OUT/decode4.log | grep -v "^{" | tail -17
# the bench with the variant fastest at batch 64 among those no slower than 2 % at batch 1
BEST=$(python3 scripts/best_decode_variant.py $OUT/decode_variants.json); echo "best: '$BEST'"
stamp generate; FASTPPL_DECODE="$BEST" timeout 150 python3 -m fastppl bench --generate --batch-sizes 1,64 --new-tokens 128 --json $OUT/bench_generate_best.json 2>&1 | grep -v -i warn | tail -9
stamp done
