#!/bin/bash
# Session 18, call 1: issue 3's four GPT-2 products against every candidate cuBLASLt's heuristic offers.
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
timeout 300 python3 scripts/gpu_cublaslt_algos.py 2>&1 | tail -60
