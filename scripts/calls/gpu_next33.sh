#!/bin/bash
# Session 17, call 2 (~5 minutes). Issue 3: the dense bench with both peers at 128 rows (twice, for the
# round-to-round spread) and at 256 rows (eval's largest auto batch), and at the default 64 once more.
# The fused decode test that failed in call 1 (its expected step name lacked ", dependent launches").
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv,noheader
timeout 60 python3 -m pytest -q -m gpu tests/test_fused_decode.py -k generate_loop > $OUT/pytest.log 2>&1; echo "pytest rc $?"
for run in 128a 64 256 128b; do
  rows=${run%[ab]}
  timeout 150 python3 -m fastppl bench --model random:gpt2 --tokens 2097152 --peers hf-compiled,fastppl \
    --batch-size $rows --quiet --json $OUT/bench$run.json > $OUT/bench$run.log 2>&1; echo "bench $run rc $?"
done
tail -1 $OUT/pytest.log
for run in 128a 64 256 128b; do echo "== $run"; grep -E "^hf|^fastppl" $OUT/bench$run.log | tail -2; done
