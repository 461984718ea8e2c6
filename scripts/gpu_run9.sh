#!/bin/bash
# Session 3, call 2: packed rows through varlen attention, the decode step's variants, start-up breakdown.
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
TOK=.devcache/data/gpt2-tokenizer; TXT=.devcache/data/tinyshakespeare.txt
timeout 150 python3 -m pytest -q -m gpu tests/test_document_attention.py tests/test_gpu.py tests/test_generate.py tests/test_bench_generate.py 2>&1 | tail -4
timeout 130 python3 scripts/gpu_varlen.py 2>&1 | grep -v -i warn | tail -14
timeout 120 python3 -m fastppl bench --corpus docs --model random:gpt2 --quiet --json $OUT/bench_docs.json 2>&1 | tail -8
timeout 210 python3 scripts/gpu_decode_variants.py 2>&1 | grep -v -i warn | tail -14
# start-up: what the interpreter, torch and the CUDA context cost before fastppl runs
/usr/bin/time -f "python3 -c pass: %e s" python3 -c pass
/usr/bin/time -f "import torch: %e s" python3 -c "import torch"
/usr/bin/time -f "import torch + CUDA context: %e s" python3 -c "import torch; torch.zeros(1, device='cuda')"
/usr/bin/time -f "import fastppl.pipeline: %e s" python3 -c "import fastppl.pipeline"
for i in 1 2; do /usr/bin/time -f "e2e (entry, no teardown) %e s" python3 -m fastppl eval --model random:gpt2 --tokenizer $TOK --data $TXT --split all --quiet --json $OUT/e2e_$i.json 2>&1 | tail -1; done
/usr/bin/time -f "e2e (main, with teardown) %e s" python3 -c "import sys; from fastppl.cli import main; sys.exit(main())" eval --model random:gpt2 --tokenizer $TOK --data $TXT --split all --quiet 2>&1 | tail -1
python3 -c "import json; r = json.load(open('$OUT/e2e_2.json')); print('stages', {k: round(v, 3) for k, v in r['stage_seconds'].items()}, 'batch', r['batch_size'], 'wall in evaluate', round(r['wall_seconds'], 2))"
