#!/usr/bin/env bash
# Third device call: trunk variants, GPU tests (bf16 vs fp32 on a trained model), start-up after the
# tokenizer change. Needs .devcache/data.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 FASTPPL_CACHE_DIR=/tmp/fastppl-cache NCCL_NVLS_ENABLE=0
export FASTPPL_SHARED_DATA=$PWD/.devcache/data
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
D=.devcache/data
timeout 240 python3 scripts/gpu_trunk.py 2>&1 | tee $OUT/trunk.log | tail -12
timeout 240 python3 -m pytest -q -m gpu -s tests/test_gpu.py tests/test_document_attention.py 2>&1 | tee $OUT/pytest_gpu.log | grep -E "fp32 nll|passed|failed|^E " | head -30
EVAL="python3 -m fastppl eval --model random:gpt2 --tokenizer $D/gpt2-tokenizer --data $D/tinyshakespeare.txt --split all --quiet"
for run in first second; do
  /usr/bin/time -f "e2e $run wall %e s" $EVAL --json $OUT/e2e-$run.json 2>&1 | tail -1
done
python3 -c "import json; d=json.load(open('$OUT/e2e-second.json')); print({k: round(v, 2) for k, v in d['stage_seconds'].items()}, d['batch_size'], round(d['tokens_per_second']), round(d['wall_seconds'], 2))"
python3 -X importtime -m fastppl eval --model random:gpt2-tiny --tokenizer $D/gpt2-tokenizer --data $D/tinyshakespeare.txt --split val --quiet 2> $OUT/importtime.txt >/dev/null
sort -t'|' -k2 -n $OUT/importtime.txt | tail -8
