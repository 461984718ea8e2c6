#!/bin/bash
# Session 13, call 2: the fused loss's variants again, with the exponential variants compiling (LOG2E as a
# tl.constexpr global), plain range for the vocabulary loop as shipped, and 256-row tiles.
export PYTHONPATH=src
timeout 280 python3 scripts/gpu_loss_tma.py > $OUT/loss_tma.log 2>&1; echo "loss_tma rc $?"
sed -n '/^| shape/,$p' $OUT/loss_tma.log; grep -i "error" $OUT/loss_tma.log | head -3 | cut -c1-400
