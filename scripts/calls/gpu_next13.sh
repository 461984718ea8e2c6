#!/bin/bash
# Session 9, last call: the committed defaults on the GPU. The aligned decode step's tests on CUDA, then
# fastppl bench --generate at batch 1 and 64 (the aligned vocabulary product now the default), then eval's
# wall time from process start over all of TinyShakespeare, twice (the second with warm caches).
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
D=$FASTPPL_SHARED_DATA
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
stamp decode-tests; timeout 100 python3 -m pytest -q tests/test_generate.py -k "aligned" 2>&1 | tail -2
stamp bench; timeout 150 python3 -m fastppl bench --generate --batch-sizes 1,64 --new-tokens 128 --quiet \
  --json $OUT/bench_generate.json 2>&1 | tail -7
for run in 1 2; do
  stamp eval-$run; s=$(date +%s.%N)
  timeout 60 python3 -m fastppl eval --model random:gpt2 --data $D/tinyshakespeare.txt --tokenizer $D/gpt2-tokenizer \
    --split all --quiet --json $OUT/eval_$run.json > /dev/null 2>$OUT/eval_$run.err
  echo "eval run $run: rc $? wall $(python3 -c "print(f'{$(date +%s.%N) - $s:.2f}')") s"
done
python3 -c "import json; r=json.load(open('$OUT/eval_2.json')); print({k: r.get(k) for k in ('compile','batch_size','stage_seconds','scoring_seconds','nll')})"
stamp done
