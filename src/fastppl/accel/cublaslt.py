"""Linear products through cuBLASLt's fastest candidate instead of its first guess (`--tune-products on`). torch
asks cuBLASLt's heuristic for one algorithm per product; at GPT-2's scoring shapes on an H100 that pick (a 192 x 192
tile) ran 5-10 % slower than another of the heuristic's eight candidates for each of the four products. ProductTuner
times the candidates once per shape on the run's own operands and keeps the fastest, and stores the pick
(cache_dir()/cublaslt_picks.json), so that a later run of the same shapes on the same GPU and cuBLASLt takes it
without timing. Only candidates that sum each dot product in one pass (no split-K) take part, so every pick gives
torch's pick's result bit for bit (tests/test_gpu.py). fastppl.accel.linear.linear routes products here while a
tuner runs.

cuBLASLt is reached through ctypes, in the copy torch loaded. Row-major torch tensors are read as column-major:
out (M, N) = x (M, K) @ weight (N, K)^T is, column-major, out^T (N, M) = op_T(weight as stored (K, N)) . x^T (K, M)."""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

COMPUTE_32F = 68        # cublasComputeType_t CUBLAS_COMPUTE_32F
R_32F, R_16F, R_16BF = 0, 2, 14   # cudaDataType_t
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8
PREF_MAX_WORKSPACE_BYTES = 1
EPILOGUE_DEFAULT, EPILOGUE_BIAS, EPILOGUE_GELU, EPILOGUE_GELU_BIAS = 1, 4, 32, 36
# cublasLtMatmulAlgoConfigAttributes_t, for describing a candidate
CONFIG_NAMES = {0: "id", 1: "tile", 2: "split_k", 3: "reduction", 4: "swizzle", 5: "custom", 6: "stages",
                7: "inner_shape", 8: "cluster"}
WORKSPACE_BYTES = 32 << 20
# the workspace allowances the tuner asks the heuristic's candidates for. Each candidate with a workspace is
# preceded by a memset of a few bytes; adding the no-workspace candidates (limit 0: 60 -> 36 memsets a GPT-2 batch)
# moved nothing (33.174 vs 33.168 ms a batch, H100) and cost 0.2 s more timing
WORKSPACE_LIMITS = (WORKSPACE_BYTES,)
_DATA_TYPES = {torch.bfloat16: R_16BF, torch.float16: R_16F}
ALIGNMENT = 256   # the heuristic's default minimum alignment of every operand's address, in bytes


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_library: Optional[ctypes.CDLL] = None
_handle = ctypes.c_void_p()
_workspaces: dict[torch.device, torch.Tensor] = {}


def _loaded_library_path() -> Optional[str]:
    """The libcublasLt that torch itself loaded (after a first product), so that both use one copy."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libcublasLt.so" in path:
                return path
    return None


def library() -> ctypes.CDLL:
    global _library
    if _library is None:
        torch.ones(8, 8, device="cuda", dtype=torch.bfloat16) @ torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
        path = _loaded_library_path()
        if path is None:
            raise RuntimeError("libcublasLt is not loaded in this process")
        lib = ctypes.CDLL(path)
        pointer, integer, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        signatures = {
            "cublasLtCreate": [pointer],
            "cublasLtMatmulDescCreate": [pointer, integer, integer],
            "cublasLtMatmulDescSetAttribute": [pointer, integer, pointer, size],
            "cublasLtMatmulDescDestroy": [pointer],
            "cublasLtMatrixLayoutCreate": [pointer, integer, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
            "cublasLtMatrixLayoutDestroy": [pointer],
            "cublasLtMatmulPreferenceCreate": [pointer],
            "cublasLtMatmulPreferenceSetAttribute": [pointer, integer, pointer, size],
            "cublasLtMatmulPreferenceDestroy": [pointer],
            "cublasLtMatmulAlgoGetHeuristic": [pointer] * 7 + [integer, pointer, pointer],
            "cublasLtMatmulAlgoConfigGetAttribute": [pointer, integer, pointer, size, pointer],
            "cublasLtMatmul": [pointer] * 14 + [size, pointer],
            "cublasLtGetVersion": [],
        }
        for name, argtypes in signatures.items():
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = argtypes
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        _check(lib.cublasLtCreate(ctypes.byref(_handle)), "cublasLtCreate")
        _library = lib
    return _library


def _workspace(device: torch.device) -> torch.Tensor:
    if device not in _workspaces:
        _workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[device]


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cuBLAS status {status}")


def _set(setter, obj, attribute: int, value: ctypes._SimpleCData) -> None:
    _check(setter(obj, attribute, ctypes.byref(value), ctypes.sizeof(value)), f"set attribute {attribute}")


@dataclass
class LinearPlan:
    """out (M, N) = epilogue(beta * out + x (M, K) @ weight (N, K)^T [+ bias (N,)]) for one shape and dtype,
    with cuBLASLt's candidate algorithms; `chosen` indexes the one run() uses (0: cuBLASLt's own first pick)."""
    rows: int
    out_features: int
    in_features: int
    dtype: torch.dtype
    epilogue: int
    beta: float = 0.0
    # the heuristic's workspace allowance: with 0 it offers kernels that need none, and so no memset before them
    workspace_limit: int = WORKSPACE_BYTES
    candidates: list = field(default_factory=list)
    chosen: int = 0

    def __post_init__(self):
        lib = library()
        data_type = _DATA_TYPES[self.dtype]
        self._desc = ctypes.c_void_p()
        self._a, self._b, self._d = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), COMPUTE_32F, R_32F), "matmul descriptor")
        _set(lib.cublasLtMatmulDescSetAttribute, self._desc, DESC_TRANSA, ctypes.c_int32(OP_T))
        _set(lib.cublasLtMatmulDescSetAttribute, self._desc, DESC_TRANSB, ctypes.c_int32(OP_N))
        _set(lib.cublasLtMatmulDescSetAttribute, self._desc, DESC_EPILOGUE, ctypes.c_uint32(self.epilogue))
        M, N, K = self.rows, self.out_features, self.in_features
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._a), data_type, K, N, K), "layout A")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._b), data_type, K, M, K), "layout B")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._d), data_type, N, M, N), "layout D")
        preference = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "preference")
        _set(lib.cublasLtMatmulPreferenceSetAttribute, preference, PREF_MAX_WORKSPACE_BYTES,
             ctypes.c_uint64(self.workspace_limit))
        if self.epilogue & EPILOGUE_BIAS:   # the heuristic reads the bias pointer's alignment; any aligned one
            self._set_bias(_workspace(torch.device("cuda", torch.cuda.current_device())).data_ptr())
        results = (_HeuristicResult * 64)()
        found = ctypes.c_int()
        _check(lib.cublasLtMatmulAlgoGetHeuristic(_handle, self._desc, self._a, self._b, self._d, self._d,
                                                  preference, 64, ctypes.byref(results), ctypes.byref(found)),
               "heuristic")
        lib.cublasLtMatmulPreferenceDestroy(preference)
        self.candidates = [results[i] for i in range(found.value) if results[i].state == 0]

    def __del__(self):
        if _library is not None and getattr(self, "_desc", None):
            _library.cublasLtMatmulDescDestroy(self._desc)
            for layout in (self._a, self._b, self._d):
                if layout:
                    _library.cublasLtMatrixLayoutDestroy(layout)

    def _set_bias(self, pointer: int) -> None:
        _set(library().cublasLtMatmulDescSetAttribute, self._desc, DESC_BIAS_POINTER, ctypes.c_void_p(pointer))

    def describe(self, index: int) -> dict:
        lib = library()
        algo = self.candidates[index].algo
        described = {"waves": round(self.candidates[index].waves, 3),
                     "workspace": self.candidates[index].workspace_size}
        for attribute, name in CONFIG_NAMES.items():
            for size_type in (ctypes.c_uint32, ctypes.c_uint16, ctypes.c_uint64):
                value, written = size_type(), ctypes.c_size_t()
                if lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attribute, ctypes.byref(value),
                                                            ctypes.sizeof(value), ctypes.byref(written)) == 0:
                    described[name] = value.value
                    break
        return described

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
            out: Optional[torch.Tensor] = None, index: Optional[int] = None) -> torch.Tensor:
        M, N, K = self.rows, self.out_features, self.in_features
        assert x.shape == (M, K) and weight.shape == (N, K) and x.is_contiguous() and weight.is_contiguous()
        if out is None:
            assert self.beta == 0.0
            out = torch.empty(M, N, dtype=self.dtype, device=x.device)
        assert out.shape == (M, N) and out.is_contiguous()
        if self.epilogue & EPILOGUE_BIAS:
            assert bias is not None and bias.shape == (N,) and bias.dtype == self.dtype
            self._set_bias(bias.data_ptr())
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(self.beta)
        algo = self.candidates[self.chosen if index is None else index]
        _check(library().cublasLtMatmul(
            _handle, self._desc, ctypes.byref(alpha), ctypes.c_void_p(weight.data_ptr()), self._a,
            ctypes.c_void_p(x.data_ptr()), self._b, ctypes.byref(beta), ctypes.c_void_p(out.data_ptr()), self._d,
            ctypes.c_void_p(out.data_ptr()), self._d, ctypes.byref(algo.algo),
            ctypes.c_void_p(_workspace(x.device).data_ptr()), self.workspace_limit,
            ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)),
            "cublasLtMatmul")
        return out

    def one_pass_candidates(self) -> list[int]:
        """Candidates that sum each dot product in one pass (no split-K), the only ones the tuner considers; it
        still compares each one's result with torch's before timing it."""
        configs = [self.describe(i) for i in range(len(self.candidates))]
        return [i for i, config in enumerate(configs)
                if config.get("split_k", 1) <= 1 and config.get("reduction", 0) == 0]


# Measured at GPT-2's shapes: timing costs ~0.3 s once per shape and saves ~1.2 % (H200) to ~2 % (H100) of the
# scoring time; torch's TunableOp, which only offers cuBLAS's default kernel on CUDA, saves nothing
MIN_TUNED_ROWS = 4096      # below this a product is latency-bound and the candidates differ by noise
MAX_TUNED_PRODUCTS = 16    # bounds the timing when batches come in many shapes (GPT-2: four products a shape)


def time_candidates(trial, indices: list[int], rounds: int = 5, calls: int = 3) -> dict[int, float]:
    """{index: median ms of trial(index)} over rounds that each time every candidate in turn, so that the GPU's
    clock drift (boost at first, then the power cap) falls on all alike: timed one after another, the first
    candidates ran at a higher clock and were picked over faster ones (H100)."""
    for i in indices:
        trial(i)
    events = {i: [] for i in indices}
    for _ in range(rounds):
        for i in indices:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                trial(i)
            end.record()
            events[i].append((start, end))
    torch.cuda.synchronize()
    return {i: sorted(s.elapsed_time(e) / calls for s, e in pairs)[rounds // 2] for i, pairs in events.items()}


def read_picks(store: Optional[Path]) -> dict:
    """Stored picks ({product name: {index, config, ms}}); {} when absent or damaged (that only costs timing)."""
    try:   # is_file too: it raises, not answers False, where a parent directory cannot be searched
        if store is None or not store.is_file():
            return {}
        picks = json.loads(store.read_text())
    except (OSError, ValueError):
        return {}
    return picks if isinstance(picks, dict) else {}


def write_picks(store: Optional[Path], picks: dict) -> None:
    """Add picks to the store, written whole and renamed into place (ranks may write at once); a store that cannot
    be written only costs the timing next time."""
    if store is None:
        return
    # the host's name too: processes of two machines sharing the cache directory may have the same pid
    partial = store.with_name(f"{store.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({**read_picks(store), **picks}, indent=1, sort_keys=True))
        os.replace(partial, store)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)


@dataclass
class Product:
    """One call of `linear` as the tuner sees it: torch's result on fresh memory, a candidate's result on fresh
    memory (to compare), and a candidate's call on scratch memory (to time)."""
    key: tuple                      # (rows, out_features, in_features, dtype, epilogue, beta)
    torch_result: Callable[[], torch.Tensor]
    candidate_result: Callable[[LinearPlan, int], torch.Tensor]
    candidate_timed: Callable[[LinearPlan, int], object]


class ProductTuner:
    """The fastest one-pass cuBLASLt candidate for each product shape this run meets, timed at the shape's first
    call on its operands, or read from `store` (picks of an earlier run on the same GPU and cuBLASLt version).
    Only candidates whose result equals torch's bit for bit on those operands are kept. timing_allowed=False takes
    stored picks only. Other products run torch's call."""

    def __init__(self, store: Optional[Path], timing_allowed: bool = True):
        self.store = store
        self.timing_allowed = timing_allowed
        self.plans: dict[tuple, Optional[LinearPlan]] = {}
        self.tuned = self.reused = self.dropped = self.untuned_for_memory = 0
        self.tuning_seconds = 0.0
        self.failure: Optional[str] = None
        self._stored = read_picks(store)
        self._new: dict = {}

    def summary(self) -> str:
        if self.failure:
            return f"torch's cuBLAS picks (cuBLASLt's candidates failed: {self.failure})"
        parts = ([f"{self.tuned} timed ({self.tuning_seconds:.2f} s)"] if self.tuned else []) + \
                ([f"{self.reused} reused from {self.store}"] if self.reused else [])
        memory = (f"; {self.untuned_for_memory} shapes left to torch: checking candidates ran out of memory"
                  if self.untuned_for_memory else "")
        if not parts:
            return "torch's cuBLAS picks (no product shape was tuned" + memory + ")"
        dropped = f"; {self.dropped} candidates left out for differing from torch's result" if self.dropped else ""
        return "cuBLASLt's fastest candidate per product shape: " + ", ".join(parts) + dropped + memory

    def fail(self, error: Exception) -> None:
        """No cuBLASLt, or a call it refused: torch's picks from here on."""
        self.failure = str(error)
        self.plans = dict.fromkeys(self.plans)

    def _name(self, key: tuple) -> str:
        rows, n_out, n_in, dtype, epilogue, beta = key
        return (f"{torch.cuda.get_device_name()}|cublasLt {library().cublasLtGetVersion()}|{rows}x{n_out}x{n_in}|"
                f"{str(dtype).replace('torch.', '')}|epilogue {epilogue}|beta {beta:g}")

    def plan(self, product: Product) -> Optional[LinearPlan]:
        """The tuned plan for this product, or None for torch's call."""
        key = product.key
        if key not in self.plans:
            self.plans[key] = None   # torch's call, unless a pick is found
            if not self.failure and key[0] >= MIN_TUNED_ROWS and key[3] in _DATA_TYPES:
                try:
                    self.plans[key] = self._stored_plan(product) or self._timed_plan(product)
                except torch.OutOfMemoryError:
                    # the candidates' extra outputs did not fit: torch's call alone may; if it does not either,
                    # the scorer's own out-of-memory handling splits the batch
                    self.untuned_for_memory += 1
                except (RuntimeError, OSError) as error:
                    self.fail(error)
        return self.plans[key]

    def _stored_plan(self, product: Product) -> Optional[LinearPlan]:
        stored = self._stored.get(self._name(product.key))
        if not isinstance(stored, dict):
            return None
        limit, index = stored.get("workspace_limit"), stored.get("index")
        if type(limit) is not int or limit not in WORKSPACE_LIMITS or type(index) is not int:
            return None   # a damaged entry only costs the timing
        plan = LinearPlan(*product.key, workspace_limit=limit)
        # the same candidate as when it was timed, still giving torch's result, or it is timed again
        if index not in plan.one_pass_candidates() or plan.describe(index) != stored.get("config") \
                or not torch.equal(product.candidate_result(plan, index), product.torch_result()):
            return None
        plan.chosen = index
        self.reused += 1
        return plan

    def _timed_plan(self, product: Product) -> Optional[LinearPlan]:
        if not self.timing_allowed \
                or sum(p is not None for p in self.plans.values()) >= MAX_TUNED_PRODUCTS:
            return None
        started = time.perf_counter()
        expected = product.torch_result()
        pairs = []
        for plan in (LinearPlan(*product.key, workspace_limit=limit) for limit in WORKSPACE_LIMITS):
            for i in plan.one_pass_candidates():
                if torch.equal(product.candidate_result(plan, i), expected):
                    pairs.append((plan, i))
                else:
                    self.dropped += 1
        del expected
        if not pairs:
            return None
        times = time_candidates(lambda k: product.candidate_timed(*pairs[k]), list(range(len(pairs))))
        plan, index = pairs[min(times, key=times.get)]
        plan.chosen = index
        self.tuning_seconds += time.perf_counter() - started
        self.tuned += 1
        self._new[self._name(product.key)] = {
            "workspace_limit": plan.workspace_limit, "index": index, "config": plan.describe(index),
            "ms": {f"workspace {p.workspace_limit}, candidate {i}": round(times[k], 4)
                   for k, (p, i) in enumerate(pairs)}}
        write_picks(self.store, self._new)
        return plan


@dataclass
class TuningChoice:
    mode: str     # "time" (time new shapes, reuse stored picks) or "off"
    reason: str


def use_tuning(setting: str, device: torch.device, dtype: torch.dtype, compiled: bool) -> TuningChoice:
    """--tune-products on|off: opt-in, since it buys a few per cent of the scoring time for a ctypes binding."""
    if device.type != "cuda" or dtype not in _DATA_TYPES:
        return TuningChoice("off", "torch's picks (tuning is for 16-bit products on CUDA)")
    if setting == "off":
        return TuningChoice("off", "torch's cuBLAS picks (--tune-products off)")
    if compiled:
        return TuningChoice("off", "torch.compile's products (tuning runs eager only)")
    return TuningChoice("time", "on (--tune-products on)")


def picks_store() -> Path:
    from ..config import cache_dir
    return cache_dir() / "cublaslt_picks.json"
