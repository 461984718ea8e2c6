#!/bin/bash
# Session 13, call 3: the new fused loss (descriptor loads, base-2 exponentials) against the one before it, as
# kernels and in `fastppl bench` (the old kernel swapped in by OLD_LOSS_BENCH), and its GPU tests.
# Before the call, here: git show 15decd7:src/fastppl/engine/fused_loss.py > .devcache/old_fused_loss.py
export PYTHONPATH=src OLD_FUSED_LOSS=$PWD/.devcache/old_fused_loss.py
timeout 150 python3 scripts/gpu_loss_compare.py > $OUT/loss_compare.log 2>&1; echo "loss_compare rc $?"
BENCH="bench --model random:gpt2 --peers hf-compiled,fastppl --tokens 2097152 --quiet"
OLD_LOSS_BENCH="import importlib.util, os, sys
s = importlib.util.spec_from_file_location('o', os.environ['OLD_FUSED_LOSS']); o = importlib.util.module_from_spec(s); s.loader.exec_module(o)
import fastppl.engine.fused_loss as f; f.fused_token_nll = o.fused_token_nll
from fastppl.cli import run; run()"
timeout 150 python3 -m fastppl $BENCH --json $OUT/bench_new.json > $OUT/bench_new.log 2>&1; echo "bench new rc $?"
timeout 150 python3 -c "$OLD_LOSS_BENCH" $BENCH --json $OUT/bench_old.json > $OUT/bench_old.log 2>&1; echo "bench old rc $?"
timeout 120 python3 -m pytest -q -m gpu tests/test_gpu.py -k "fused_loss or bit_for_bit or bf16" tests/test_fused_loss.py 2>&1 | tail -2
cat $OUT/loss_compare.log | tail -12
for f in new old; do echo "== bench $f"; grep -E "^\||fastppl|peer" $OUT/bench_$f.log | tail -6; done
