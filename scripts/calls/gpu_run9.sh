#!/bin/bash
# Session 3, call 2: packed rows through varlen attention, the decode step's variants and bench, start-up.
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
TOK=.devcache/data/gpt2-tokenizer; TXT=.devcache/data/tinyshakespeare.txt
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
stamp varlen; timeout 100 python3 scripts/gpu_varlen.py > $OUT/varlen.log 2>&1; echo "rc $?"; grep -v -i warn $OUT/varlen.log | tail -16
stamp docs; timeout 100 python3 -m fastppl bench --corpus docs --model random:gpt2 --quiet --json $OUT/bench_docs.json 2>&1 | tail -8
stamp decode; DECODE_BUDGET_S=100 DECODE_ONLY="scatter_ (old default),index_copy (default),additive + bucket 64" timeout 125 python3 scripts/gpu_decode_variants.py > $OUT/decode.log 2>&1; echo "rc $?"; grep -v -i warn $OUT/decode.log | tail -12
stamp generate; timeout 95 python3 -m fastppl bench --generate --batch-sizes 1,64 --new-tokens 128 --quiet --json $OUT/bench_generate.json 2>&1 | tail -9
stamp startup
/usr/bin/time -f "python3 -c pass: %e s" python3 -c pass
/usr/bin/time -f "import torch: %e s" python3 -c "import torch"
/usr/bin/time -f "import torch + CUDA context: %e s" python3 -c "import torch; torch.zeros(1, device='cuda')"
/usr/bin/time -f "import fastppl.pipeline: %e s" python3 -c "import fastppl.pipeline"
for i in 1 2; do /usr/bin/time -f "e2e (entry, no teardown) %e s" python3 -m fastppl eval --model random:gpt2 --tokenizer $TOK --data $TXT --split all --quiet --json $OUT/e2e_$i.json 2>&1 | tail -1; done
/usr/bin/time -f "e2e (main, with teardown) %e s" python3 -c "import sys; from fastppl.cli import main; sys.exit(main())" eval --model random:gpt2 --tokenizer $TOK --data $TXT --split all --quiet 2>&1 | tail -1
python3 -c "import json; r = json.load(open('$OUT/e2e_2.json')); print('stages', {k: round(v, 3) for k, v in r['stage_seconds'].items()}, 'batch', r['batch_size'], 'wall in evaluate', round(r['wall_seconds'], 2))"
left=$(( 470 - ($(date +%s) - T0) )); stamp "pytest ($left s left)"; [ $left -gt 20 ] && timeout $left python3 -m pytest -q -x -m gpu tests/test_document_attention.py 2>&1 | tail -3
stamp done
