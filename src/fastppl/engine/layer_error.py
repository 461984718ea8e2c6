"""Error by layer (--layer-error): a model and a reference of one shape run in lockstep on the layer-major path
(fastppl.engine.streamed), and after each block i their hidden states are compared on the scored positions (the
relative L2 error ‖h - h_ref‖ / ‖h_ref‖ and the cosine, mean and worst), and the divergence is measured of a hybrid:
the reference's embeddings and blocks 0..i, then the model's blocks i+1.. and its final norm and output projection.
The hybrids' KLD from the reference, read down the layers, says which block's error the output feels (the "which
layer hurts" table); the last hybrid differs from the reference by the final norm and output projection alone.

At block i the model's block runs over every hybrid begun before it (the block is on the device once per wave), so
a wave holds up to n_layer + 2 residual streams per batch, and a batch runs n_layer (n_layer - 1) / 2 more blocks.
The sums are fp64 on the device, reduced (summed, maxed, minned) over positions, read once at the end."""
from __future__ import annotations

from itertools import zip_longest
from typing import Callable, Sequence

import torch

from .divergence import KLD_COLUMN
from .score import DeviceBatch
from .streamed import normed_one_at_a_time

# per layer: the sums of the relative L2 error and of the cosine, the worst of each, and the hybrid's KLD sum
REL_SUM, REL_MAX, COS_SUM, COS_MIN, KLD_SUM = range(5)


class LayerErrors:
    """The per-layer sums of a run, on the device."""

    def __init__(self, n_layer: int, device: torch.device):
        self.sums = torch.zeros(n_layer, 5, dtype=torch.float64, device=device)
        self.sums[:, COS_MIN] = float("inf")
        self.positions = torch.zeros((), dtype=torch.float64, device=device)
        self.hybrids: list[list[torch.Tensor]] = []   # per batch of the wave: each layer's hybrid, final-normed

    def compare(self, layer: int, hidden: torch.Tensor, reference: torch.Tensor, score_mask: torch.Tensor) -> None:
        """The relative L2 error and cosine of one batch's hidden states (B, T, C) at the scored positions."""
        hidden, reference = hidden[score_mask].float(), reference[score_mask].float()       # (n, C)
        norm, reference_norm = hidden.norm(dim=-1), reference.norm(dim=-1)
        error = (hidden - reference).norm(dim=-1)
        # equal states (a zero error) are no error, whatever their norm
        relative = torch.where(error == 0, 0.0, error / reference_norm).double()
        cosine = ((hidden * reference).sum(-1) / (norm * reference_norm)).double()
        sums = self.sums[layer]
        if relative.numel():
            sums[REL_SUM] += relative.sum()
            sums[REL_MAX] = torch.maximum(sums[REL_MAX], relative.max())
            sums[COS_SUM] += cosine.sum()
            sums[COS_MIN] = torch.minimum(sums[COS_MIN], cosine.min())

    def compared_wave(self, trunks: Sequence, wave: Sequence[DeviceBatch],
                      more_waves: bool) -> list[list[torch.Tensor]]:
        """Both trunks' final hidden states of each batch of the wave ([model's], [reference's]), run block by
        block in lockstep; each layer's comparison added, and each batch's hybrids kept (self.hybrids)."""
        model, reference = trunks
        states, reference_states = model.residual_streams(wave), reference.residual_streams(wave)
        hybrids = [[] for _ in wave]   # per batch: (layer, state) of each hybrid begun
        # zip_longest runs both generators to their end: zip would leave the reference's last block unreleased
        for layer, (block, reference_block) in enumerate(zip_longest(model.blocks_of_wave(more_waves),
                                                                     reference.blocks_of_wave(more_waves))):
            for i, batch in enumerate(wave):
                for j, state in enumerate(hybrids[i]):   # each replaced as it goes: one stream more at most
                    hybrids[i][j] = model.run_block(block, state, batch)
                states[i] = model.run_block(block, states[i], batch)
                reference_states[i] = reference.run_block(reference_block, reference_states[i], batch)
                self.compare(layer, states[i][0], reference_states[i][0], batch.score_mask)
                x = reference_states[i][0]
                # the model's own block inputs (its RoPE) from here on; blocks may update their input in place
                hybrids[i].append((x.clone(), states[i][1]))
        self.hybrids = [normed_one_at_a_time(model, batch_hybrids) for batch_hybrids in hybrids]
        return [normed_one_at_a_time(model, states), normed_one_at_a_time(reference, reference_states)]

    def add_hybrids(self, loss_fn: Callable, i: int, reference_hidden: torch.Tensor, batch: DeviceBatch) -> None:
        """Each hybrid's KLD from the reference, summed over batch i's scored positions; its hybrids freed."""
        for layer, hidden in enumerate(self.hybrids[i]):
            columns = loss_fn(hidden, reference_hidden, batch.targets, batch.score_mask, batch.scored_rows)
            self.sums[layer, KLD_SUM] += columns[..., KLD_COLUMN].sum(dtype=torch.float64)
        self.hybrids[i] = []
        self.positions += batch.score_mask.sum()

    def table(self) -> list[dict]:
        """One row per block: its errors' means and worst, and its hybrid's mean KLD (None with no position)."""
        sums, positions = self.sums.cpu().tolist(), float(self.positions)
        mean = lambda total: total / positions if positions else None  # noqa: E731
        return [dict(layer=layer, relative_l2_mean=mean(row[REL_SUM]), relative_l2_max=row[REL_MAX] if positions
                     else None, cosine_mean=mean(row[COS_SUM]), cosine_min=row[COS_MIN] if positions else None,
                     kld_with_reference_through_layer=mean(row[KLD_SUM]))
                for layer, row in enumerate(sums)]
