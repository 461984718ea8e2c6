"""Resumable runs (--resume DIR): the running float64 sums and the set of finished windows, saved atomically.

A run's batches are a deterministic function of its arguments (fastppl.data.packing), so "the first k
batches" names the same windows in every run with the same arguments. A checkpoint holds the sums after
exactly k batches; a resumed run loads them and scores batches k, k+1, ... as the uninterrupted run would,
so it adds the same float64 values in the same order and ends with exactly the same result. Windows scored
after the last checkpoint of a killed run are scored again (their sums died with the process); no window is
ever counted twice. The checkpoint also records the arguments (a fingerprint), and refuses other ones.

DIR/checkpoint.npz: arrays of DeviceSums, `finished_windows` (bool, by window index) and `meta` (JSON text).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import time
import zipfile
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from .data.packing import BatchPlan
from .engine.score import DeviceSums
from .errors import FastpplError
from .report.files import remove_stale_temporaries, write_atomic

CHECKPOINT_FILE = "checkpoint.npz"
FORMAT_VERSION = 4   # 2: every DeviceSums field is checkpointed (1 lacked the squared sums); 3: resolved arguments;
# 4: a divergence run's per-token columns are engine.divergence.COLUMNS (12; 5 before)
# EvalConfig fields that do not change what is computed: where results go, how often to checkpoint, and whether
# products are tuned (a tuned product gives torch's result bit for bit)
NOT_IN_FINGERPRINT = ("quiet", "resume", "per_doc", "checkpoint_seconds", "checkpoint_batches", "tune_products")
SUM_FIELDS = tuple(f.name for f in dataclasses.fields(DeviceSums))   # all of them, so none can be forgotten


def document_ids_sha256(documents) -> str:
    """sha256 of the documents' ids in order: per-document results are keyed by them, so a checkpoint of the same
    texts under other names (their contents are the corpus digest) is not resumed."""
    h = hashlib.sha256()
    for document in documents:
        raw = document.id.encode("utf-8", errors="surrogatepass")
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.hexdigest()


def model_files(spec: str) -> Optional[list]:
    """(name, sha256 of the contents) of a local checkpoint directory's files: weights retrained at the same path
    differ even with the same size and modification time. A full hash, not a sample: about 1.5 s a GB on one core,
    paid once per --resume run, against hours of scoring; a sampled digest could miss a few changed weights."""
    path = Path(spec).expanduser()
    if not path.is_dir():
        return None
    return [[p.name, file_sha256(p)] for p in sorted(path.iterdir()) if p.is_file()]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def resolved_path(spec: Optional[str]) -> Optional[str]:
    """A local path as an absolute one (./model and /home/me/model are the same run); names as given."""
    if spec is None or not Path(spec).expanduser().exists():
        return spec
    return str(Path(spec).expanduser().resolve())


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of every weight's and buffer's name, shape, dtype and float64 sum, reduced where the weights are:
    models of other shapes, seeds or checkpoints differ in it, without hashing gigabytes of bytes."""
    with torch.no_grad():   # blocks kept in a checkpoint's stored form (streamed) count by their stored bytes
        state = {name: t for name, t in model.state_dict().items() if not t.is_meta}
        sums = torch.stack([t.detach().sum(dtype=torch.float64) for t in state.values()]).cpu().tolist()
        described = [[name, list(t.shape), str(t.dtype), total] for (name, t), total in zip(state.items(), sums)]
        for i, block in enumerate(getattr(model, "stored_blocks", None) or ()):
            # one tensor at a time: blocks left in their files (host memory short) are read here, not all held
            described += [[f"stored_blocks.{i}.{j}", list(raw.shape), str(raw.dtype),
                           float(raw.sum(dtype=torch.float64))] for j, raw in enumerate(block.stored_tensors())]
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()


def run_fingerprint(config_dict: dict, resolved: dict, **derived) -> dict:
    """What must match for a checkpoint to be resumed: the arguments, with the values they resolved to in place of
    those that resolve (resolved: {argument: value}, e.g. ctx None -> 256: --ctx 256 and the default are one
    run), and what the inputs are (derived: digests of the corpus, tokenizer and model files, ...)."""
    fingerprint = {k: v for k, v in config_dict.items() if k not in NOT_IN_FINGERPRINT}
    assert set(resolved) <= set(fingerprint), "only arguments resolve"
    fingerprint.update(resolved)
    # --data paths stay as given: they are the documents' ids, which the per-document results name
    fingerprint.update(model=resolved_path(fingerprint["model"]), tokenizer=resolved_path(fingerprint["tokenizer"]),
                       data_dir=resolved_path(fingerprint["data_dir"]))
    assert not set(derived) & set(fingerprint), "a derived value would hide an argument"
    fingerprint["per_token"] = bool(fingerprint.get("per_token"))   # the path may move, the buffer may not
    fingerprint.update(derived)
    fingerprint["format"] = FORMAT_VERSION
    return json.loads(json.dumps(fingerprint))   # tuples -> lists, so that it compares with a loaded one


def finished_windows(plans: Sequence[BatchPlan], n_batches: int, n_windows: int) -> np.ndarray:
    finished = np.zeros(n_windows, dtype=bool)
    for plan in plans[:n_batches]:
        finished[plan.windows] = True
    return finished


class Checkpointer:
    """Saves DIR/checkpoint.npz every `every_batches` batches and every `every_seconds` seconds."""

    def __init__(self, directory: str, fingerprint: dict, plans: Sequence[BatchPlan], n_windows: int,
                 every_batches: Optional[int], every_seconds: float):
        self.directory = Path(directory).expanduser()
        if self.directory.exists() and not self.directory.is_dir():
            raise FastpplError(f"--resume {directory}: is a file; give a directory for the checkpoint")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise FastpplError(f"--resume {directory}: cannot create the directory ({e.strerror})") from None
        self.path = self.directory / CHECKPOINT_FILE
        remove_stale_temporaries(self.path)   # a save that a kill cut short
        self.fingerprint = fingerprint
        self.plans = plans
        self.n_windows = n_windows
        self.every_batches = every_batches
        self.every_seconds = every_seconds
        self.last_saved = time.monotonic()

    def load(self, sums: DeviceSums) -> int:
        """Restore sums from the checkpoint; the number of batches already done (0 without a checkpoint)."""
        if not self.path.exists():
            return 0
        unreadable = FastpplError(f"{self.path}: is not a readable fastppl checkpoint; delete it to start over")
        try:
            # without blocking: open() of a FIFO waits for a writer that never comes
            with open(os.open(self.path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                if not stat.S_ISREG(mode):
                    what = "a FIFO" if stat.S_ISFIFO(mode) else "a device"   # a directory fails to open
                    raise FastpplError(f"{self.path}: is {what}, not a checkpoint file; remove it to start over")
                with np.load(f, allow_pickle=False) as stored:
                    arrays = {name: stored[name] for name in stored.files}
            meta = json.loads(str(arrays.pop("meta")))
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):   # cut short, empty, or not a zip
            raise unreadable from None
        # a zip that numpy reads may still not be ours, or be damaged inside: every part is checked before use
        if not isinstance(meta, dict) or not isinstance(meta.get("fingerprint"), dict):
            raise unreadable
        saved = meta["fingerprint"]
        if saved != self.fingerprint:
            differing = sorted(k for k in set(saved) | set(self.fingerprint) if saved.get(k) != self.fingerprint.get(k))
            details = "; ".join(f"{k}: {saved.get(k)!r} then, {self.fingerprint.get(k)!r} now" for k in differing[:4])
            raise FastpplError(
                f"--resume {self.directory}: its checkpoint was made with other arguments ({details}); "
                "rerun with the same arguments, or give another --resume directory"
            )
        done = meta.get("batches_done")
        finished = arrays.pop("finished_windows", None)
        if type(done) is not int or not 0 <= done <= len(self.plans) or finished is None or finished.dtype != bool:
            raise unreadable
        if not np.array_equal(finished, finished_windows(self.plans, done, self.n_windows)):
            raise FastpplError(f"{self.path}: its finished windows do not match this run's plan; "
                               "delete it to start over")
        restored = {}
        for name in SUM_FIELDS:
            tensor = getattr(sums, name)
            if tensor is None:
                if name in arrays:
                    raise unreadable
                continue
            stored = arrays.get(name)
            if stored is None or stored.dtype.kind != "f" or stored.size != tensor.numel():
                raise unreadable
            restored[name] = stored
        # a loss that is NaN or infinite never becomes finite again: refused now, not after scoring the rest
        # (per_token and a divergence run's per-token columns are NaN where unscored)
        if not all(np.isfinite(stored).all() for name, stored in restored.items()
                   if name not in ("per_token", "divergence")):
            raise FastpplError(f"{self.path}: its sums are not finite (NaN or infinity): the run it saved had a "
                               "non-finite loss, or the file is damaged; delete it to start over")
        for name, stored in restored.items():   # only once all are known good: no half-restored sums
            tensor = getattr(sums, name)
            tensor.copy_(torch.from_numpy(stored).reshape(tensor.shape))
        return done

    def save(self, batches_done: int, sums: DeviceSums) -> None:
        """Host copies of the sums (a device sync) written beside the checkpoint, then renamed over it."""
        arrays = {name: getattr(sums, name).cpu().numpy() for name in SUM_FIELDS if getattr(sums, name) is not None}
        arrays["finished_windows"] = finished_windows(self.plans, batches_done, self.n_windows)
        meta = {"fingerprint": self.fingerprint, "batches_done": batches_done, "batches": len(self.plans)}
        arrays["meta"] = np.array(json.dumps(meta))

        def write(f):
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())   # the rename must not land before the data does
        write_atomic(str(self.path), write, binary=True)
        self.last_saved = time.monotonic()

    def after_batch(self, batches_done: int, sums: DeviceSums) -> None:
        due_by_count = self.every_batches and batches_done % self.every_batches == 0
        if due_by_count or time.monotonic() - self.last_saved >= self.every_seconds:
            self.save(batches_done, sums)
