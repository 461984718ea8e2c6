#!/bin/bash
# Session 6, last GPU call: after the review fixes, the fused decode step's GPU tests and the fused
# residual-norm tests (layer_norm_rows is now shared by both kernels). ~80 s.
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
timeout 140 python3 -m pytest -q -x tests/test_fused_decode.py "tests/test_gpu.py::test_fused_residual_norms_match_plain_forward" > $OUT/tests.log 2>&1; echo "rc $?"; tail -3 $OUT/tests.log
grep -E "^E |FAILED" $OUT/tests.log | head -10
