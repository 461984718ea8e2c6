#!/bin/bash
# Session 18: `fastppl eval --split all` warm, this session's code against session 17's last (3cfcb02, unpacked
# into .devcache/old_src by `git archive 3cfcb02 src | tar -x -C .devcache/old_src`), interleaved, same machine.
. scripts/calls/eval_wall.sh   # FASTPPL_SHARED_DATA, run_eval
export FASTPPL_CACHE_DIR=/tmp/fastppl-cache-ab
nvidia-smi --query-gpu=name --format=csv,noheader
new() { export PYTHONPATH=src; run_eval $1 python3 -m fastppl | cut -c1-75; }
old() { export PYTHONPATH=.devcache/old_src/src; run_eval $1 python3 -m fastppl | cut -c1-75; }
new cold_new; old cold_old
for i in 1 2 3 4 5; do old old$i; new new$i; done
