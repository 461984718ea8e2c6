"""Where `fastppl eval --split all` spends its first scoring batch (session 11): cProfile over evaluate(),
in a process whose caches are warm. Prints the functions with the most cumulative and own time."""
import cProfile
import os
import pstats
import sys

from fastppl.config import EvalConfig
from fastppl.pipeline import evaluate

data = os.environ["FASTPPL_SHARED_DATA"]
config = EvalConfig(model="random:gpt2", data=[f"{data}/tinyshakespeare.txt"], tokenizer=f"{data}/gpt2-tokenizer",
                    split="all", quiet=True)
profile = cProfile.Profile()
profile.enable()
result = evaluate(config)
profile.disable()
print("stage_seconds", {k: round(v, 3) for k, v in result["stage_seconds"].items()})
stats = pstats.Stats(profile, stream=sys.stdout)
stats.sort_stats("cumulative").print_stats(45)
stats.sort_stats("tottime").print_stats(25)
