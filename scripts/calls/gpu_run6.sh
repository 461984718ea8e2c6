#!/bin/bash
# Session 2, call 1: fused-loss variants, scorer profile, Llama-1B bench with the compiled peer.
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
nvidia-smi --query-gpu=name,memory.used --format=csv
timeout 200 python3 scripts/gpu_loss_variants.py 2>&1 | grep -v Warning | tail -25
timeout 60 python3 scripts/gpu_profile_scorer.py 2>&1 | tail -22
timeout 300 python3 -m fastppl bench --model random:llama-1b --tokens 262144 --variants --json $OUT/llama.json 2>&1 | tail -14
