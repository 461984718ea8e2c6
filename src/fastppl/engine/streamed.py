"""Layer-major scoring, for a model whose weights do not fit the device: the batches are grouped in waves whose
hidden states fit; for each wave, every batch's residual stream is made, then each block runs over all the wave's
batches, then the final norm and the loss (the resident scorer's own, fastppl.engine.score.make_loss_fn). The
blocks rest in host memory and cross to the device once per wave, not once per batch, into two reused buffers:
the next block is copied (on CUDA on a side stream, from pinned memory) while the current one computes.

    wave 0:  embed b0 b1 b2 | block 0: b0 b1 b2 | block 1: b0 b1 b2 | ... | norm + loss b0 b1 b2
    copies:                 ^ block 0           ^ block 1 (during block 0)  ^ block 2 (during block 1)

Each batch runs the same operations on the same shapes as the resident forward (the model's layer-major split,
fastppl.models.spec.ModelSpec), so its NLL is bit for bit the resident path's; the sums are added in the same
batch order."""
from __future__ import annotations

import copy
import time
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn

from ..data.batching import Batch
from ..models.spec import PLAIN_SPLIT, LayerSplit
from .score import DeviceBatch, DeviceSums, LossFn, accumulate, batch_on_device


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class StreamedBlocks:
    """A model's blocks brought to the device a block at a time into two reused buffers: copied from host memory,
    or (stored, a quantized checkpoint's StoredBlocks, already on the device) decoded there. Step k of the run
    (block k % n_layer of a wave) uses buffer k % 2: fetch(k + 1) fills the other buffer with the next block, after
    the step that used it last is done (release), while step k computes."""

    def __init__(self, blocks: nn.ModuleList, device: torch.device, dtype: torch.dtype,
                 stored: Optional[list] = None):
        self.stored = stored
        self.host = [list(block.parameters()) for block in blocks]
        shapes = {tuple(tuple(p.shape) for p in params) for params in self.host}
        assert len(shapes) == 1, "the layer-major path needs blocks of one shape"
        def buffer() -> nn.Module:   # stored blocks leave the model's on the meta device: only their shapes
            block = copy.deepcopy(blocks[0])
            return (block.to_empty(device=device) if stored is not None else block).to(device, dtype)
        self.buffers = [buffer().requires_grad_(False) for _ in range(2)]
        self.buffer_parameters = [list(buffer.parameters()) for buffer in self.buffers]
        self.named_buffer_parameters = [dict(buffer.named_parameters()) for buffer in self.buffers]
        self.block_bytes = tensor_bytes(self.buffer_parameters[0])
        self.cuda = device.type == "cuda"
        # blocks read from files: the host reads them, in order on the compute stream (nothing to overlap)
        self.host_reads = bool(stored) and getattr(stored[0], "reads_files", False)
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.copied: list = [None, None]     # per buffer: the event of its last copy's end (CUDA)
        self.released: list = [None, None]   # per buffer: the event of its last use's end (CUDA)
        self.copy_events, self.wait_events = [], []   # (begin, end) pairs, read once at the end
        self.copy_seconds, self.bytes_streamed, self.step = 0.0, 0, 0

    def fetch(self, step: int, layer: int) -> None:
        slot = step % 2
        if not self.cuda or self.host_reads:   # nothing to overlap
            started = time.perf_counter()
            self._fill(slot, layer)
            self.copy_seconds += time.perf_counter() - started
            self.copied[slot] = None
        else:
            with torch.cuda.stream(self.copy_stream):
                if self.released[slot] is not None:
                    self.copy_stream.wait_event(self.released[slot])
                begin, end = _timing_event(), _timing_event()
                begin.record()
                self._fill(slot, layer)
                end.record()
            self.copied[slot] = end
            self.copy_events.append((begin, end))
        self.bytes_streamed += self.block_bytes

    def _fill(self, slot: int, layer: int) -> None:
        if self.stored is not None:
            self.stored[layer].fill(self.named_buffer_parameters[slot])
            return
        for target, source in zip(self.buffer_parameters[slot], self.host[layer]):
            target.copy_(source, non_blocking=True)

    def take(self, step: int) -> nn.Module:
        """The buffer of this step, once its copy is done. The compute stream's wait is timed: the copying it did
        not hide."""
        slot = step % 2
        if self.cuda and self.copied[slot] is not None:
            before, after = _timing_event(), _timing_event()
            before.record()
            torch.cuda.current_stream().wait_event(self.copied[slot])
            after.record()
            self.wait_events.append((before, after))
        return self.buffers[slot]

    def release(self, step: int) -> None:
        if self.cuda:
            self.released[step % 2] = torch.cuda.Event()
            self.released[step % 2].record()

    def copy_times(self) -> tuple[float, float]:
        """(seconds spent copying, of which hidden behind compute); reads the CUDA events (a host sync)."""
        if not self.cuda:
            return self.copy_seconds, 0.0
        torch.cuda.synchronize()
        elapsed = lambda pairs: sum(begin.elapsed_time(end) for begin, end in pairs) / 1000  # noqa: E731
        copying = elapsed(self.copy_events)   # the side stream's; the host's reads hid nothing
        return copying + self.copy_seconds, max(copying - elapsed(self.wait_events), 0.0)


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


class StreamedTrunk:
    """One model's final hidden states for a wave of batches, layer-major: its embeddings and final norm on the
    device, its blocks streamed."""

    def __init__(self, model: nn.Module, device: torch.device, split: LayerSplit = PLAIN_SPLIT):
        self.model, self.split = model, split
        dtype = model.lm_head.weight.dtype
        self.blocks = StreamedBlocks(model.blocks, device, dtype, getattr(model, "stored_blocks", None))

    def residual_streams(self, wave: Sequence[DeviceBatch]) -> list[tuple[torch.Tensor, tuple]]:
        """Each batch's residual stream (B, T, C) and its blocks' other inputs."""
        return [self.split.residual_stream(self.model, batch.input_ids, batch.packed[0] if batch.packed else None)
                for batch in wave]

    def blocks_of_wave(self, more_waves: bool) -> Iterator[nn.Module]:
        """Each block of the model in turn, on the device, for the wave to run; with more_waves, the next wave's
        first block is copied during the last one."""
        blocks = self.blocks
        if blocks.step == 0:
            blocks.fetch(0, 0)
        n_layer = len(blocks.host)
        for layer in range(n_layer):
            block = blocks.take(blocks.step)
            if layer + 1 < n_layer or more_waves:
                blocks.fetch(blocks.step + 1, (layer + 1) % n_layer)
            yield block
            blocks.release(blocks.step)
            blocks.step += 1

    def run_block(self, block: nn.Module, state: tuple[torch.Tensor, tuple], batch: DeviceBatch) -> tuple:
        x, block_inputs = state
        return self.split.block(block, x, *block_inputs, batch.document_ids), block_inputs

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.split.final_norm(self.model, x)

    def final_hidden(self, wave: Sequence[DeviceBatch], more_waves: bool) -> list[torch.Tensor]:
        """[(B, T, C)] of each batch of the wave."""
        states = self.residual_streams(wave)
        for block in self.blocks_of_wave(more_waves):
            for i, batch in enumerate(wave):   # in place: one batch's stream more than the wave's at once
                states[i] = self.run_block(block, states[i], batch)
        return normed_one_at_a_time(self, states)


def normed_one_at_a_time(trunk: StreamedTrunk, states: list[tuple[torch.Tensor, tuple]]) -> list[torch.Tensor]:
    """The final norm of each state, each state dropped as its norm is made (states is emptied): one batch's
    stream more than the wave's at once, not twice the wave's."""
    normed = []
    while states:
        x, _ = states.pop(0)
        normed.append(trunk.final_norm(x))
        del x
    return normed


def plan_waves(plans: Sequence, hidden_bytes: Callable[[object], int], capacity: int) -> list[list]:
    """The batch plans in order, cut into waves whose hidden states (hidden_bytes of each) fit capacity bytes;
    a batch that alone exceeds it is a wave of its own (the caller refuses such a run first)."""
    waves, wave, held = [], [], 0
    for plan in plans:
        need = hidden_bytes(plan)
        if wave and held + need > capacity:
            waves.append(wave)
            wave, held = [], 0
        wave.append(plan)
        held += need
    return waves + [wave] if wave else waves


@torch.inference_mode()
def score_streamed(trunks: Sequence[StreamedTrunk], loss_fn: LossFn, waves: Sequence[Sequence],
                   build: Callable[[object], Batch], sums: DeviceSums, device: torch.device, gathers: bool,
                   on_batch: Optional[Callable[[Batch], None]] = None, layer_errors=None) -> None:
    """Every wave's batches scored into sums, in order. trunks: the model's, then (a divergence run) the reference
    model's; loss_fn(*their final hidden states, targets, score_mask, scored_rows) -> (B, T[, columns]).
    layer_errors (fastppl.engine.layer_error.LayerErrors): both trunks run in lockstep, compared block by block."""
    for w, plans in enumerate(waves):
        batches = [build(plan) for plan in plans]
        wave = [batch_on_device(batch, device, gathers) for batch in batches]
        more_waves = w + 1 < len(waves)
        hidden = layer_errors.compared_wave(trunks, wave, more_waves) if layer_errors is not None else \
            [trunk.final_hidden(wave, more_waves) for trunk in trunks]
        for i, (batch, on_device) in enumerate(zip(batches, wave)):
            nll = loss_fn(*(h[i] for h in hidden), on_device.targets, on_device.score_mask, on_device.scored_rows)
            if layer_errors is not None:
                layer_errors.add_hybrids(loss_fn, i, hidden[1][i], on_device)
            for h in hidden:
                h[i] = None   # freed as the wave is scored
            accumulate(sums, nll, on_device.score_mask, device, on_device.position_ids, batch.target_document,
                       batch.token_index)
            if on_batch is not None:
                on_batch(batch)
