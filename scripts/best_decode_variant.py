"""The FASTPPL_DECODE options of the variant in a decode_variants.json (scripts/gpu_decode_variants.py) that is
fastest at batch 64 among those at most 2 % slower than the default at batch 1 ("" = the default)."""
import json
import sys

rows = [r for r in json.load(open(sys.argv[1]))["rows"] if "ms_per_step" in r and not r["inductor"]]
by = {(r["variant"], r["batch"]): r for r in rows}
default_b1 = by.get(("index_copy (default)", 1), {}).get("ms_per_step", float("inf"))
candidates = [r for r in rows if r["batch"] == 64 and (r["variant"], 1) in by
              and by[(r["variant"], 1)]["ms_per_step"] <= 1.02 * default_b1]
print(min(candidates, key=lambda r: r["ms_per_step"])["options"] if candidates else "")
