#!/usr/bin/env bash
# Fourth device call: every bench once, each bounded by a timeout, so the call fits the 10-minute limit.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 FASTPPL_CACHE_DIR=/tmp/fastppl-cache NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
D=.devcache/data
EVAL="python3 -m fastppl eval --model random:gpt2 --tokenizer $D/gpt2-tokenizer --data $D/tinyshakespeare.txt --split all --quiet"
for run in first second; do
  /usr/bin/time -f "e2e $run wall %e s" timeout 60 $EVAL --json $OUT/e2e-$run.json 2>&1 | tail -1
done
python3 -c "import json; d=json.load(open('$OUT/e2e-second.json')); print({k: round(v, 2) for k, v in d['stage_seconds'].items()}, d['batch_size'], round(d['tokens_per_second']), round(d['wall_seconds'], 2), d['mlp_epilogue'])"
timeout 150 python3 -m fastppl bench --model random:gpt2 --tokens 2097152 --naive-tokens 262144 --quiet --json $OUT/bench.json > $OUT/bench.txt 2>&1; tail -8 $OUT/bench.txt
timeout 140 python3 -m fastppl bench --corpus docs --model random:gpt2 --quiet --json $OUT/bench_docs.json > $OUT/bench_docs.txt 2>&1; tail -14 $OUT/bench_docs.txt
timeout 170 python3 -m fastppl bench --generate --batch-sizes 1,64 --new-tokens 128 --quiet --json $OUT/bench_generate.json > $OUT/bench_generate.txt 2>&1; tail -14 $OUT/bench_generate.txt
timeout 60 python3 -m fastppl bench --model random:llama-1b --peers hf-bf16,fastppl --tokens 262144 --quiet --json $OUT/bench_llama.json > $OUT/bench_llama.txt 2>&1; tail -5 $OUT/bench_llama.txt
