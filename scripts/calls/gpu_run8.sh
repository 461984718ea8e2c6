#!/bin/bash
# Session 3, call 1: GPU tests (CUDA-graph scorer), dense bench with the no-graphs variant, end-to-end start-up,
# cached vs uncached sliding windows on the Llama-1B shape, decode-step Inductor options.
export PYTHONPATH=src FASTPPL_SHARED_DATA=$PWD/.devcache/data
TOK=.devcache/data/gpt2-tokenizer; TXT=.devcache/data/tinyshakespeare.txt
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -4
timeout 150 python3 -m fastppl bench --model random:gpt2 --peers hf-compiled,fastppl --tokens 2097152 --variants --quiet --json $OUT/bench_gpt2.json 2>&1 | tail -9
for i in 1 2; do /usr/bin/time -f "e2e wall %e s" python3 -m fastppl eval --model random:gpt2 --tokenizer $TOK --data $TXT --split all --quiet --json $OUT/e2e_$i.json 2>&1 | tail -2; done
python3 - <<'PY'
import json; r = json.load(open(__import__("os").environ["OUT"] + "/e2e_2.json")); print("stages", r.get("stage_seconds"))
PY
# 16 documents of TinyShakespeare, for cached sliding windows (rows hold whole documents)
python3 - <<'PY'
import json; t = open(".devcache/data/tinyshakespeare.txt").read(); n = len(t) // 16
open("/tmp/shake16.jsonl", "w").write("".join(json.dumps({"text": t[i*n:(i+1)*n]}) + "\n" for i in range(16)))
PY
for kv in off on; do timeout 100 python3 -m fastppl eval --model random:llama-1b --tokenizer $TOK --data /tmp/shake16.jsonl --window sliding --ctx 2048 --stride 512 --kv-cache $kv --quiet --json $OUT/sliding_$kv.json 2>&1 | tail -1; done
python3 - <<'PY'
import json, os; o = os.environ["OUT"]
for kv in ("off", "on"):
    try:
        r = json.load(open(f"{o}/sliding_{kv}.json")); print("sliding kv", kv, "nll", r.get("nll"), "tok/s", r.get("tokens_per_second"), "scoring s", r.get("scoring_seconds"), "wall", r.get("wall_seconds"), r.get("kv_cache"))
    except Exception as e: print("sliding", kv, "failed", e)
PY
timeout 170 python3 scripts/gpu_decode_variants.py 2>&1 | grep -v -i warn | tail -8
