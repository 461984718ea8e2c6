"""The Runner: the one object that owns where a run's weights rest, which forward scores its batches, and the record
of what ran, which the report reads. fastppl.pipeline asks it to prepare, to size the batches and to score them;
it asks accel/ (the transforms) and engine/ (the loops).

Where the weights rest (--placement):
  resident   the whole model on the device; the batches run one at a time through the plain, fused or compiled
             scorer (fastppl.accel.apply), or the cached sliding windows (fastppl.engine.cached_sliding)
  streamed   the blocks in host memory (pinned on CUDA), the embeddings, final norm and output projection on the
             device; the windows run layer-major, in waves whose hidden states fit (fastppl.engine.streamed)
  auto       resident where the weights take at most RESIDENT_SHARE of the device's memory (or of
             --max-gpu-memory), else streamed
"""
from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn as nn

from .accel.apply import (Acceleration, apply_fusions, choose_acceleration, choose_tuning, divergence_loss_for,
                          divergence_score_fn_for, score_fn_for, streamed_split, tuned_products)
from .accel.batch_size import MAX_AUTO_BATCH, auto_batch_size, scoring_memory_bound
from .accel.compile import allow_shapes, compile_score_fn
from .config import EvalConfig, gguf_spec
from .data.batching import batch_from_plan, make_batch
from .data.packing import BatchPlan, split_rows
from .data.streams import WindowPlan, sliding_stride
from .engine.cached_sliding import score_cached_sliding
from .engine.divergence import make_divergence_loss_fn
from .engine.layer_error import LayerErrors
from .engine.score import DeviceSums, make_loss_fn, score_batches, score_plans
from .engine.streamed import StreamedTrunk, plan_waves, score_streamed, tensor_bytes
from .errors import FastpplError, first_line
from .models.attention import document_attention_backend, varlen_failure
from .models.hf_backend import HFCausalLM
from .models.hf_offload import hf_weights_bytes
from .models.loading import local_checkpoint_dir, weights_bytes
from .models.registry import spec_of
from .stages import Batches, Prepared, Run, RunRecord, Windows

# auto keeps a model resident where its weights take at most this share of the device's memory: the rest holds a
# batch's activations
RESIDENT_SHARE = 0.9


def gib(n_bytes: float) -> str:
    """A size as --max-gpu-memory takes it."""
    return f"{n_bytes / 2**30:.2f}GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.2f}MiB"


@dataclass(frozen=True)
class Placement:
    name: str                 # "resident", "streamed" or "offloaded" (a transformers model, fastppl.models.hf_offload)
    reason: str
    limit: Optional[int]      # --max-gpu-memory in bytes; None: the device's own memory
    offload_bytes: Optional[int] = None   # offloaded: what of the weights the GPU may hold

    @property
    def streamed(self) -> bool:
        return self.name == "streamed"


def device_capacity(config: EvalConfig, device: torch.device) -> tuple[Optional[int], str]:
    """(bytes the run may hold on the device, what says so); None off CUDA without --max-gpu-memory."""
    if config.max_gpu_memory is not None:
        return config.max_gpu_memory, f"--max-gpu-memory {gib(config.max_gpu_memory)}"
    if device.type != "cuda":
        return None, "host memory"
    # the properties, not the free memory: they need no CUDA context, which warms up beside the loading
    total = torch.cuda.get_device_properties(device).total_memory
    return total, f"the device's {gib(total)}"


def choose_placement(config: EvalConfig, device: torch.device, dtype: torch.dtype) -> Placement:
    """--placement, and auto's choice and reason, from the weights' size (read from the config alone) before they
    are loaded; --placement resident with weights that cannot fit is refused now."""
    if config.placement == "streamed":
        return Placement("streamed", "--placement streamed", config.max_gpu_memory)
    if config.layer_error:   # the config refuses it with --placement resident
        return Placement("streamed", "--layer-error (the layer-major path runs both models block by block)",
                         config.max_gpu_memory)
    capacity, what = device_capacity(config, device)
    needed = None
    if capacity is not None:
        needed = weights_bytes(config.model, config.backend, dtype)
        if needed is not None and config.reference_model:
            reference = weights_bytes(config.reference_model, config.backend, dtype)
            needed = None if reference is None else needed + reference
    if needed is None and capacity is not None and device.type == "cuda" and config.placement == "auto" \
            and not config.reference_model:
        offloaded = offload_placement(config, dtype, capacity, what)
        if offloaded is not None:
            return offloaded
    if needed is None:
        why = "no --max-gpu-memory off CUDA" if capacity is None else "the model runs through transformers"
        reason = "--placement resident" if config.placement == "resident" else f"auto: resident ({why})"
        return Placement("resident", reason, config.max_gpu_memory)
    fits = needed <= RESIDENT_SHARE * capacity
    if config.placement == "resident":
        if not fits:
            raise FastpplError(f"--placement resident: the weights need {gib(needed)}, more than "
                               f"{RESIDENT_SHARE:.0%} of {what}; use --placement streamed (or auto)")
        return Placement("resident", "--placement resident", config.max_gpu_memory)
    if fits:
        return Placement("resident", f"auto: the weights ({gib(needed)}) fit {what}", config.max_gpu_memory)
    return Placement("streamed", f"auto: the weights ({gib(needed)}) exceed {RESIDENT_SHARE:.0%} of {what}",
                     config.max_gpu_memory)


def offload_placement(config: EvalConfig, dtype: torch.dtype, capacity: int, what: str) -> Optional[Placement]:
    """auto for a checkpoint directory transformers runs: offloaded where its weights (from its config) exceed
    RESIDENT_SHARE of capacity, else None (resident)."""
    directory = local_checkpoint_dir(config.model) if not gguf_spec(config.model) else None
    needed = hf_weights_bytes(directory, dtype) if directory is not None else None
    if needed is None or needed <= RESIDENT_SHARE * capacity:
        return None
    return Placement("offloaded", f"auto: the weights ({gib(needed)}) exceed {RESIDENT_SHARE:.0%} of {what}, and "
                                  "transformers runs the model: part of it in host memory", config.max_gpu_memory,
                     offload_bytes=int(RESIDENT_SHARE * capacity))


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.pin_memory()


def rest_in_host_memory(model: nn.Module, device: torch.device) -> str:
    """The model's blocks stay in host memory, pinned on CUDA (copies at the bus' speed, beside compute); the rest
    of it goes to the device. Returns how the blocks rest, for the report; pinning that fails leaves them in
    pageable memory with one warning."""
    blocks = model.blocks
    model.blocks = nn.ModuleList()
    try:
        model.to(device)
    finally:
        model.blocks = blocks
    if getattr(model, "stored_blocks", None) is not None:   # a quantized checkpoint's, or blocks left in files
        return model.stored_blocks[0].rests_in.format(device=device.type)
    blocks.to("cpu")   # random weights were drawn on the device
    if device.type != "cuda":
        return "host memory (the device's own)"
    try:
        for parameter in blocks.parameters():
            if not parameter.is_pinned():
                parameter.data = pinned(parameter.data)
    except RuntimeError as error:
        print(f"fastppl: warning: pinning the weights in host memory failed ({first_line(error)}); the blocks are "
              "copied from pageable memory, at a lower speed", file=sys.stderr)
        return f"pageable host memory (pinning failed: {first_line(error)})"
    return "pinned host memory"


def check_same_shape(model: nn.Module, reference: nn.Module) -> None:
    """--layer-error compares the models block by block: the reference must have the model's blocks and width."""
    shapes = [(type(m).__name__, len(m.blocks), spec_of(m).shape(m.config).width) for m in (model, reference)]
    if shapes[0] != shapes[1]:
        (family, layers, width), (ref_family, ref_layers, ref_width) = shapes
        raise FastpplError(f"--layer-error compares the two models block by block, so the reference needs the "
                           f"model's shape ({family}, {layers} blocks of width {width}); the reference is "
                           f"{ref_family}, {ref_layers} blocks of width {ref_width}: give a reference of the same "
                           "architecture, or drop --layer-error")


@dataclass
class ScoringRun:
    """What Runner.score returns to the pipeline."""
    started: float                 # when scoring proper began (after the products were routed to the tuner)
    backed_off_to: int             # rows an out-of-memory batch was cut to (0: none)
    products: str                  # the report's products line


class Runner:
    """One run's models, where their weights rest, the scorer that runs, and what it did."""

    def __init__(self, run: Run, placement: Placement, model: nn.Module, reference: Optional[nn.Module] = None):
        self.run, self.placement, self.model, self.reference = run, placement, model, reference
        self.trunks: list[StreamedTrunk] = []
        self.blocks_rest_in: Optional[str] = None
        self.waves = 0
        self.layer_errors: Optional[LayerErrors] = None
        self.prepared: Optional[Prepared] = None

    @property
    def streamed(self) -> bool:
        return self.placement.streamed

    @property
    def models(self) -> list[nn.Module]:
        return [self.model] + ([self.reference] if self.reference is not None else [])

    def prepare(self, plan: WindowPlan) -> Prepared:
        """The models placed, the run's transforms chosen and applied, and its scorer (of both models' divergence
        with a reference model)."""
        run, model, reference = self.run, self.model, self.reference
        if self.streamed:
            return self._prepare_streamed(plan)
        offloaded = getattr(model, "offloaded", False)
        if not offloaded:   # accelerate placed an offloaded model's parts, and its hooks move them
            self.model = model = model.to(run.device)
        acceleration = self._choose_acceleration(model, plan, "off" if offloaded else run.config.compile)
        if offloaded:
            acceleration = dataclasses.replace(acceleration, compile_reason="off (accelerate's hooks run the model)")
        acceleration = apply_fusions(model, run.device, acceleration)
        if reference is not None:
            acceleration, score_fn = divergence_score_fn_for(model, reference, acceleration, run.config.batching,
                                                             run.config.loss_chunk_rows)
        else:
            score_fn = score_fn_for(model, acceleration, run.config.loss_chunk_rows)
        self.prepared = Prepared(model, acceleration, score_fn)
        return self.prepared

    def _choose_acceleration(self, model: nn.Module, plan: WindowPlan, compile: str) -> Acceleration:
        config = self.run.config
        return choose_acceleration(
            model, self.run.device, self.run.dtype, loss="chunked" if self.reference is not None else config.loss,
            compile=compile, batching=config.batching, n_scored=plan.n_scored, n_positions=plan.n_positions,
            n_documents=len(plan.scored_documents))

    def _prepare_streamed(self, plan: WindowPlan) -> Prepared:
        run, config = self.run, self.run.config
        for model in self.models:
            if spec_of(model) is None:
                if config.layer_error:
                    raise FastpplError("--layer-error runs fastppl's native model families block by block; this "
                                       "model runs through transformers: drop --layer-error")
                raise FastpplError("--placement streamed runs fastppl's native model families block by block; this "
                                   "model runs through transformers: use --placement resident")
        self.blocks_rest_in = ", ".join(dict.fromkeys(rest_in_host_memory(m, run.device) for m in self.models))
        acceleration = dataclasses.replace(self._choose_acceleration(self.model, plan, "off"),
                                           compile_reason="off (the streamed path runs its blocks eager)")
        splits = [streamed_split(model, run.device, acceleration) for model in self.models]
        self.trunks = [StreamedTrunk(model, run.device, split) for model, (split, _) in zip(self.models, splits)]
        if config.layer_error:
            check_same_shape(self.model, self.reference)
            self.layer_errors = LayerErrors(len(self.model.blocks), run.device)
        acceleration = splits[0][1]
        if self.reference is None:
            loss_fn = make_loss_fn(self.model, config.loss_chunk_rows, acceleration.loss)
            loss_fn.gathers_scored_rows = acceleration.loss == "fused"
        else:
            acceleration, fused_fn = divergence_loss_for(self.model, self.reference, acceleration, config.batching)
            loss_fn = make_divergence_loss_fn(self.model, self.reference, config.loss_chunk_rows, fused_fn)
            loss_fn.gathers_scored_rows = True
        self.prepared = Prepared(self.model, acceleration, loss_fn)
        return self.prepared

    # ---- memory of the streamed path ---------------------------------------------------------------------------
    def _device_limit(self) -> Optional[int]:
        if self.placement.limit is not None:
            return self.placement.limit
        if self.run.device.type != "cuda":
            return None
        # what the run holds already (the kept weights) is counted apart; a tenth kept for what torch allocates
        # beside the bound (cuBLAS workspaces, the allocator's fragments)
        free, _total = torch.cuda.mem_get_info(self.run.device)
        return int(RESIDENT_SHARE * (free + torch.cuda.memory_reserved(self.run.device)))

    def _kept_bytes(self) -> int:
        """The weights the streamed path keeps on the device: all but the blocks, and two blocks' buffers."""
        kept = 0
        for trunk in self.trunks:
            in_blocks = {id(p) for p in trunk.model.blocks.parameters()}
            rest = {id(p): p for p in trunk.model.parameters() if id(p) not in in_blocks}
            kept += tensor_bytes(rest.values()) + 2 * trunk.blocks.block_bytes
            kept += sum(block.stored_bytes for block in trunk.blocks.stored or ())
        return kept

    def _working_bytes(self, rows: int, seq_len: int) -> float:
        """One batch's activations through one block and the loss (accel.batch_size's bound, of each model)."""
        run, config = self.run, self.run.config
        loss = self.prepared.acceleration.loss if self.reference is None else "chunked"
        scores = run.device.type != "cuda" or run.dtype == torch.float32   # else attention writes no scores
        chunk_rows = min(config.loss_chunk_rows, rows * seq_len)   # a loss chunk holds at most the batch
        return sum(scoring_memory_bound(m, seq_len, run.dtype.itemsize, loss, chunk_rows,
                                        attention_scores=scores).total(rows) for m in self.models)

    def _hidden_bytes(self, rows: int, seq_len: int) -> int:
        """A batch's residual streams kept through a wave, and a rotary family's cos and sin (fp32, at most one
        row per position)."""
        per_position = 0
        for model in self.models:
            spec, shape = spec_of(model), spec_of(model).shape(model.config)
            per_position += shape.width * self.run.dtype.itemsize + (8 * shape.q_width // shape.n_head
                                                                     if spec.rotary else 0)
        if self.layer_errors is not None:   # a hybrid's stream per block, beside the two models'
            per_position += len(self.model.blocks) * spec_of(self.model).shape(self.model.config).width \
                * self.run.dtype.itemsize
        return rows * seq_len * per_position

    def _fits(self, limit: int, rows: int, seq_len: int) -> bool:
        return self._kept_bytes() + self._working_bytes(rows, seq_len) + self._hidden_bytes(rows, seq_len) <= limit

    def waves_of(self, plans: list[BatchPlan]) -> list[list[BatchPlan]]:
        """The batches grouped in waves whose hidden states fit beside the kept weights and one batch's working
        memory; a run where not even one batch fits is refused, naming the --ctx and --max-gpu-memory that would."""
        limit = self._device_limit()
        if limit is None or not plans:
            return [list(plans)]
        rows, seq_len = max(p.n_rows for p in plans), max(p.seq_len for p in plans)
        if not self._fits(limit, rows, seq_len):
            raise self._wave_error(limit, rows, seq_len)
        capacity = limit - self._kept_bytes() - self._working_bytes(rows, seq_len)
        return plan_waves(plans, lambda p: self._hidden_bytes(p.n_rows, p.seq_len), capacity)

    def _wave_error(self, limit: int, rows: int, seq_len: int) -> FastpplError:
        needed = self._kept_bytes() + self._working_bytes(rows, seq_len) + self._hidden_bytes(rows, seq_len)
        low, high = 0, seq_len   # the largest context that fits: the bound grows with it
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if self._fits(limit, rows, middle) else (low, middle - 1)
        what = f"--max-gpu-memory {gib(limit)}" if self.placement.limit else f"the device's free {gib(limit)}"
        fix = f"raise --max-gpu-memory to at least {gib(needed)}"
        if low >= 2:
            fix += f", or lower --ctx to {low}" + (" (or --batch-size)" if rows > 1 else "")
        return FastpplError(f"{what} cannot hold one wave of {rows} x {seq_len} positions beside the weights kept on "
                            f"the device ({gib(self._kept_bytes())}): it needs {gib(needed)}; {fix}")

    # ---- batch size and scoring ----------------------------------------------------------------------------------
    def auto_batch_size(self, plan: WindowPlan, ctx: int) -> tuple[int, str]:
        """--batch-size auto: resident, the most rows that fit (probed with the longest window, or a memory bound);
        streamed, the most rows whose working memory and hidden states take half of what the kept weights leave."""
        run, config, refs = self.run, self.run.config, plan.refs
        if self.streamed and run.device.type == "cuda":
            room = (self._device_limit() - self._kept_bytes()) / 2
            largest = min(MAX_AUTO_BATCH, len(refs))
            rows = next((r for r in range(largest, 1, -1) if self._fits(self._kept_bytes() + room, r, ctx)), 1)
            return rows, "auto: streamed, half the memory the kept weights leave"
        if self.streamed:
            return min(8, len(refs)), "auto: 8 rows off CUDA"
        probe_sums = DeviceSums.zeros(ctx, run.device)
        longest = [refs[int(np.argmax(plan.window_lengths))]]   # every rank probes with the same window
        # rows of ctx positions: a padded or packed row is ctx long, and a bucket's rows hold as many positions
        bound = scoring_memory_bound(self.model, ctx, run.dtype.itemsize, self.prepared.acceleration.loss,
                                     config.loss_chunk_rows) \
            if not config.reference_model else None   # the bound is of one model: two models' scorer is probed
        return auto_batch_size(
            lambda rows: score_batches(self.prepared.score_fn, [make_batch(
                longest * rows, plan.stream_ids, plan.target_offsets, rows, ctx)], probe_sums, run.device),
            len(refs), run.device, bound=bound)

    def score(self, windows: Windows, batches: Batches, plans: list[BatchPlan], sums: DeviceSums,
              on_batch: Callable, on_step: Callable[[int], None], resumable: bool) -> ScoringRun:
        """plans (this rank's of the batches, those not yet scored) scored into sums, by the scorer prepared: the
        cached sliding windows, the planned batches one at a time (out of memory: the failing batch split by rows
        and scored again, unless the run is resumable, whose checkpoints count whole batches), or layer-major in
        waves."""
        run, config, prepared, plan = self.run, self.run.config, self.prepared, windows.plan
        if prepared.acceleration.compiled:
            allow_shapes(len({(p.n_rows, p.seq_len) for p in batches.plans}))
        build = lambda p: batch_from_plan(p, plan.refs, plan.stream_ids, plan.target_offsets)  # noqa: E731
        if self.streamed:
            waves = self.waves_of(plans)
            self.waves = len(waves)
            started = time.perf_counter()
            score_streamed(self.trunks, prepared.score_fn, waves, build, sums, run.device,
                           prepared.score_fn.gathers_scored_rows, on_batch, self.layer_errors)
            return ScoringRun(started, 0, "torch's picks (the streamed path)")
        tuning = choose_tuning(config.tune_products, self.model, run.device, run.dtype, prepared.acceleration.compiled,
                               windows.use_kv_cache)
        backed_off_to = 0
        with tuned_products(self.model, tuning) as products:
            started = time.perf_counter()   # after the linears are routed to the tuner
            if windows.use_kv_cache:
                # each window runs over its new tokens only (fastppl.engine.cached_sliding)
                score_cached_sliding(
                    self.model, plan.refs, plan.stream_ids, plan.target_offsets, windows.ctx,
                    sliding_stride(config.stride, windows.ctx), batches.size, sums, run.device, on_step=on_step,
                    compile_fn=compile_score_fn if prepared.acceleration.compiled else None,
                    chunk_rows=config.loss_chunk_rows, document_starts=plan.document_starts)
            else:
                backed_off_to = score_plans(prepared.score_fn, plans, build, sums, run.device, on_batch=on_batch,
                                            split=None if resumable else split_rows)
            return ScoringRun(started, backed_off_to, products())

    def record(self, windows: Windows) -> RunRecord:
        """What ran, for the report: the backend, where the weights rested and what streaming did."""
        packed = self.prepared.acceleration.batching == "packed" and not windows.use_kv_cache
        streaming = None
        if self.streamed:
            copying, hidden = 0.0, 0.0
            for trunk in self.trunks:
                seconds = trunk.blocks.copy_times()
                copying, hidden = copying + seconds[0], hidden + seconds[1]
            streaming = dict(waves=self.waves, bytes_streamed=sum(t.blocks.bytes_streamed for t in self.trunks),
                             copy_seconds=copying, copy_seconds_hidden=hidden, blocks_rest_in=self.blocks_rest_in)
        model = self.model
        return RunRecord(
            backend=f"transformers ({model.why})" if isinstance(model, HFCausalLM) else "native",
            placement=self.placement.name, placement_reason=self.placement.reason, streaming=streaming,
            layer_error=self.layer_errors.table() if self.layer_errors is not None else None,
            # after any fallback: varlen, flex or sdpa-mask
            document_attention=document_attention_backend(self.run.device, self.run.dtype) if packed else None,
            document_attention_fallback=varlen_failure())
