#!/usr/bin/env bash
# Second device call: GPU tests, start-up stage timings, generation and Llama-1B speed. Needs .devcache/data.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 FASTPPL_CACHE_DIR=/tmp/fastppl-cache NCCL_NVLS_ENABLE=0
export FASTPPL_SHARED_DATA=$PWD/.devcache/data
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
D=.devcache/data
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_document_attention.py 2>&1 | tail -4 | tee $OUT/pytest_gpu.log
EVAL="python3 -m fastppl eval --model random:gpt2 --tokenizer $D/gpt2-tokenizer --data $D/tinyshakespeare.txt --split all --quiet"
for run in first second; do
  /usr/bin/time -f "e2e $run wall %e s" $EVAL --json $OUT/e2e-$run.json 2>&1 | tail -2
done
python3 -c "import json; d=json.load(open('$OUT/e2e-second.json')); print({k: round(v, 2) for k, v in d['stage_seconds'].items()}, d['batch_size'], d['batching'], round(d['tokens_per_second']))"
timeout 120 python3 -m fastppl generate --model random:gpt2 --tokenizer $D/gpt2-tokenizer --prompt "To be, or not" --max-new-tokens 256 --json $OUT/gen1.json 2>&1 | tail -4
timeout 150 python3 -m fastppl eval --model random:llama-1b --tokenizer $D/gpt2-tokenizer --data $D/tinyshakespeare.txt --split all --ctx 2048 --quiet --json $OUT/llama.json 2>&1 | tail -2
