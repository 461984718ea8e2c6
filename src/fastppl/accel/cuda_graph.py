"""The eager scorer replayed from CUDA graphs: one graph per batch shape that repeats, so that a batch is
one graph launch instead of ~150 kernel launches with the host's gaps between them.

A shape is captured on its second batch (the first runs eagerly and warms up cuBLAS and Triton), and
replayed from the third on; a shape seen once (a last, shorter batch) never pays for a capture. Packed
rows run eagerly: their document layout changes from batch to batch. The scores come back in the graph's
own output tensor, overwritten by the next replay; the scoring loop folds them into its sums on the same
stream before the next batch is enqueued, so stream order keeps them intact."""
from __future__ import annotations

from typing import Optional

import torch

MAX_GRAPHS = 4   # each graph keeps one batch's activations allocated: bound the memory they hold


class GraphedScoreFn:
    def __init__(self, score_fn, max_graphs: int = MAX_GRAPHS):
        self.score_fn = score_fn
        self.max_graphs = max_graphs
        self.seen: dict[tuple, int] = {}
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], torch.Tensor]] = {}

    def __call__(self, input_ids: torch.Tensor, targets: torch.Tensor, score_mask: torch.Tensor,
                 position_ids: Optional[torch.Tensor] = None, document_ids=None) -> torch.Tensor:
        if document_ids is not None or not input_ids.is_cuda:
            return self.score_fn(input_ids, targets, score_mask, position_ids, document_ids)
        key = tuple(input_ids.shape)
        entry = self.graphs.get(key)
        if entry is None:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] < 2 or len(self.graphs) >= self.max_graphs:
                return self.score_fn(input_ids, targets, score_mask)
            try:
                entry = self.graphs[key] = self._capture(input_ids, targets, score_mask)
            except RuntimeError:
                # e.g. out of memory while capturing: this shape stays eager, and the eager call below
                # raises again if memory really is short (the scoring loop then splits the batch)
                self.seen[key] = -(10 ** 9)
                torch.cuda.synchronize()
                return self.score_fn(input_ids, targets, score_mask)
        graph, static_inputs, static_output = entry
        for static, given in zip(static_inputs, (input_ids, targets, score_mask)):
            static.copy_(given)
        graph.replay()
        return static_output

    def _capture(self, *inputs: torch.Tensor):
        static_inputs = tuple(x.clone() for x in inputs)
        # the eager batches' cached blocks go back first, so that the graph's pool is not held beside them
        torch.cuda.empty_cache()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # capture wants its warm-up off the default stream
            self.score_fn(*static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_output = self.score_fn(*static_inputs)
        return graph, static_inputs, static_output
