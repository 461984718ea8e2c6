#!/bin/bash
# Session 16: one call for when the device may come only once (~8.5 minutes). The essentials of gpu_next29.sh and
# gpu_next30.sh: the fused decode step's GPU tests (dependent launches bit for bit among them), its timing with and
# without dependent launches; the split-KV attention's CUDA tests and its quick timing at batch 64; issue 3's sweep.
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv,noheader
timeout 110 python3 -m pytest -q -m gpu tests/test_fused_decode.py > $OUT/pytest.log 2>&1; echo "pytest fused rc $?"
timeout 90 python3 scripts/gpu_decode_pdl.py > $OUT/decode_pdl.log 2>&1; echo "decode_pdl rc $?"
timeout 100 python3 -m pytest -q tests/test_kv_cache.py tests/test_generate.py -k "split_kv" > $OUT/pytest_attn.log 2>&1; echo "pytest attn rc $?"
ATTN_QUICK=1 PYTHONPATH=src:scripts timeout 110 python3 scripts/gpu_decode_attention.py > $OUT/decode_attention.log 2>&1; echo "decode_attention rc $?"
PYTHONPATH=src:scripts timeout 110 python3 scripts/gpu_scorer_sweep.py > $OUT/sweep.log 2>&1; echo "sweep rc $?"
tail -2 $OUT/pytest.log; tail -2 $OUT/pytest_attn.log
grep -E "^\||^FAILED|^fused" $OUT/decode_pdl.log
grep -E "^\||FAILED|failed|B64.*block 64" $OUT/decode_attention.log
grep -E "^\|" $OUT/sweep.log
