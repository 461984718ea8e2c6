"""torch.compile's work kept across processes in fastppl's cache folder (FASTPPL_CACHE_DIR): Inductor's FX graph
cache and AOTAutograd's cache on disk (TORCHINDUCTOR_CACHE_DIR, under cache_dir()/inductor), and one artifacts file
per model shape, dtype, loss, device name and torch version (torch.compiler.save_cache_artifacts, under
cache_dir()/compile), loaded before compiling so that a process finds its kernels even where Inductor's own folder
was cleared. A damaged or stale file costs a recompile and one warning line, never a wrong result: its bytes are
checked against the SHA-256 stored with them before torch reads them, and anything torch refuses is dropped.
Whether a warm file exists also lowers --compile auto's threshold (accel/compile.py)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..config import cache_dir

FORMAT = b"fastppl compile artifacts 1\n"


def warn(message: str) -> None:
    print(f"fastppl: warning: {message}", file=sys.stderr)


def configure_caches() -> None:
    """Inductor's and AOTAutograd's on-disk caches on, in fastppl's cache folder (a TORCHINDUCTOR_CACHE_DIR set by
    the user wins)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    inductor_config.fx_graph_cache = True
    if hasattr(functorch_config, "enable_autograd_cache"):   # torch >= 2.6
        functorch_config.enable_autograd_cache = True


def cache_key(model: torch.nn.Module, what: str, *others: torch.nn.Module) -> str:
    """The artifacts file's name for compiling `what` (the loss, or "divergence") of model (and others) on the
    device and in the dtype of its weights: its class and parameter shapes, the device's name, torch's version."""
    weight = next(model.parameters())
    device = weight.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu {platform.machine()}"
    shapes = [[type(m).__name__, sorted((n, list(p.shape), str(p.dtype)) for n, p in m.named_parameters())]
              for m in (model, *others)]
    text = json.dumps([torch.__version__, device_name, what, shapes])
    return f"{type(model).__name__.lower()}-{what.split()[0]}-{hashlib.sha256(text.encode()).hexdigest()[:20]}"


def artifacts_path(key: str) -> Path:
    return cache_dir() / "compile" / f"{key}.artifacts"


def has_artifacts(key: str) -> bool:
    return artifacts_path(key).is_file()


def load_artifacts(key: str) -> str:
    """Fill torch's caches from the key's file before compiling: "loaded", "none" (no file, or a torch without
    artifacts) or "damaged" (warned about and removed: the compile runs afresh and writes a new one)."""
    path = artifacts_path(key)
    if not path.is_file() or not hasattr(torch.compiler, "load_cache_artifacts"):
        return "none"
    try:
        data = path.read_bytes()
        if not data.startswith(FORMAT):
            raise ValueError("not a fastppl artifacts file")
        digest, payload = data[len(FORMAT):len(FORMAT) + 64], data[len(FORMAT) + 64:]
        if hashlib.sha256(payload).hexdigest().encode() != digest:
            raise ValueError("its contents do not match their digest")
        quiet = logging.getLogger("torch.compiler._cache")   # which logs a refusal as a traceback, then returns None
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)
        try:
            loaded = torch.compiler.load_cache_artifacts(payload)
        finally:
            quiet.setLevel(level)
        if loaded is None:
            raise ValueError("torch could not read it")
    except Exception as error:   # noqa: BLE001 (whatever torch raises on stale bytes: recompiling is the remedy)
        warn(f"ignoring the compile cache {path} ({str(error).splitlines()[0][:200] or type(error).__name__}); "
             "compiling afresh")
        path.unlink(missing_ok=True)
        return "damaged"
    return "loaded"


def save_artifacts(key: str) -> None:
    """What this process compiled, to the key's file (written whole, then renamed into place)."""
    if not hasattr(torch.compiler, "save_cache_artifacts"):
        return
    try:
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        payload = saved[0]
        path = artifacts_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_bytes(FORMAT + hashlib.sha256(payload).hexdigest().encode() + payload)
        os.replace(partial, path)
    except Exception as error:   # noqa: BLE001 (a cache that cannot be written costs the next run time only)
        warn(f"could not save the compile cache ({type(error).__name__}: {str(error)[:200]})")


def _cache_counts() -> tuple[int, int, int]:
    """(hits, misses, bypasses) of Inductor's FX graph cache and AOTAutograd's cache so far in this process."""
    from torch._dynamo.utils import counters
    return tuple(counters["inductor"][f"fxgraph_cache_{what}"] + counters["aot_autograd"][f"autograd_cache_{what}"]
                 for what in ("hit", "miss", "bypass"))


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


@dataclass
class CompileRecord:
    """A compiled scorer's compiles: the seconds of the calls that compiled, and where their code came from."""
    key: str
    artifacts: str                 # load_artifacts' answer
    seconds: float = 0.0
    graphs: int = 0
    hits: int = 0
    misses: int = 0
    bypasses: int = 0

    def timed_call(self, fn, *args):
        graphs, counts, started = _graphs_compiled(), _cache_counts(), time.perf_counter()
        out = fn(*args)
        if _graphs_compiled() != graphs:   # this call compiled: its time is the compile's (and one batch's launch)
            self.seconds += time.perf_counter() - started
            self.graphs += _graphs_compiled() - graphs
            hits, misses, bypasses = (now - before for now, before in zip(_cache_counts(), counts))
            self.hits, self.misses, self.bypasses = self.hits + hits, self.misses + misses, self.bypasses + bypasses
        return out

    def source(self) -> str:
        if self.graphs == 0:
            return "nothing compiled"
        if self.hits and not self.misses:
            return "from the cache"
        if self.hits:
            return "partly from the cache"
        return "compiled afresh" if self.misses or not self.bypasses else "compiled afresh (not cacheable)"

    def note(self) -> str:
        damaged = ", its cache file damaged" if self.artifacts == "damaged" else ""
        return f"; compiled in {self.seconds:.1f} s, {self.source()}{damaged}"


def finish(record: Optional[CompileRecord]) -> None:
    """After a compiled run: its new code saved for the next process (nothing to save when all came from the
    cache)."""
    if record is not None and record.graphs and (record.misses or record.artifacts != "loaded"):
        save_artifacts(record.key)
