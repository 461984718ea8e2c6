#!/bin/bash
# Session 11, call 2: the interpreter teardown skipped (cli.run's os._exit), 3 warm runs; then cProfile of
# evaluate() to see what the first scoring batch's 0.6 s of first use is.
. scripts/calls/eval_wall.sh   # PYTHONPATH, D, EVAL, now, run_eval
run_eval cold python3 -m fastppl
for i in 1 2 3; do run_eval fast-exit-$i python3 -m fastppl; run_eval plain-exit-$i python3 -c "import sys; from fastppl.cli import main; sys.exit(main(sys.argv[1:]))"; done
python3 scripts/gpu_first_use.py > /dev/null 2>&1
python3 scripts/gpu_first_use.py > $OUT/profile.txt 2>&1
head -60 $OUT/profile.txt | cut -c1-160
