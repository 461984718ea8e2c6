#!/bin/bash
# Written in session 14 for the next session's first call (~8 minutes): what session 14 could not run for want of
# an H200 (its two calls ran on an H100, then its device time was spent on machines that did not start).
# 1. Issue 3's targets on the H200: the dense bench against compiled transformers, with session 14's loss and forward.
# 2. Where the dense scorer's time goes now (kernel by kernel, and between kernels), and the loss tiles on its one-loop form.
# 3. Issue 4 on a model whose context holds every document (ctx 2048 >= 1,501 tokens with BOS): no window re-reads
#    context, so packed / dense measures packing itself (with GPT-2's ctx 1024 the windowing caps it at 83 %).
#    Batch 8: the lm-eval-style baseline writes (B, T, 128,256) fp32 logits; 4,000 documents: padded rows of 2048
#    are ~6x padding, and 10,000 documents would not fit the call (the ratio does not depend on the count).
. scripts/calls/eval_wall.sh   # PYTHONPATH, FASTPPL_SHARED_DATA
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 130 python3 -m fastppl bench --model random:gpt2 --tokens 2097152 --peers hf-compiled,fastppl --quiet \
  --json $OUT/bench.json > $OUT/bench.log 2>&1; echo "bench rc $?"
timeout 45 python3 scripts/gpu_profile_scorer.py > $OUT/profile.log 2>&1; echo "profile rc $?"
timeout 45 python3 scripts/gpu_gaps_trace.py > $OUT/gaps.log 2>&1; echo "gaps rc $?"
timeout 75 python3 scripts/gpu_loss_configs.py > $OUT/loss_configs.log 2>&1; echo "loss_configs rc $?"
timeout 220 python3 -m fastppl bench --corpus docs --model random:llama-1b --seq 2048 --batch-size 8 --documents 4000 --quiet \
  --json $OUT/docs_llama.json > $OUT/docs_llama.log 2>&1; echo "docs llama rc $?"
grep -E "^hf|^fastppl|^what" $OUT/bench.log | tail -3
grep -E "^\||GPU time" $OUT/profile.log | head -14
grep -v Warning $OUT/gaps.log | grep -v "^\s*$" | tail -20
tail -12 $OUT/loss_configs.log
tail -9 $OUT/docs_llama.log
