"""Decode steps as CUDA graphs, one per padded batch size.

Each size's graph reads its `DecodeBuffers`: one packed static buffer of the step's integers
(input_ids, positions, seq_lens, slot_mapping, row ids) and the runner's whole request table,
which attention reads through the row ids. A step picks the smallest captured size >= its
batch, refills that buffer with one host-to-device copy, records the new slots in the table
(one index_put) and replays the graph. Padding rows point at the padding row of the request
table (all slot 0, the scratch slot) with length 1, so they compute something harmless. The
caller reserves the fusion workspace for the largest size before it builds the runner (capture
runs no collective setup), and capture runs each forward once, so every dispatch decision is
made (and cached) there. Each size is captured with programmatic dependent launch on or off as
``pdl_for_size`` says (`layers.kernels.pdl`; a replay keeps what its capture recorded).
"""
from __future__ import annotations

import bisect
from typing import Callable, Optional

import torch

from arfusion.engine.common.progress import Progress
from arfusion.engine.models.forward_batch import ForwardBatch, KVCache
from arfusion.engine.runtime.step_plan import DecodeBuffers, RequestTable, StepPlan
from arfusion.layers.kernels.pdl import pdl_mode
from arfusion.layers.sharded_logits import ShardedLogits

Model = Callable[[ForwardBatch, KVCache], ShardedLogits]

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def capture_sizes(max_bs: int) -> list[int]:
    """The padded decode batch sizes captured for a largest batch of ``max_bs``."""
    sizes = [bs for bs in CAPTURE_SIZES if bs <= max_bs]
    if not sizes or sizes[-1] < max_bs:
        sizes.append(max_bs)
    return sizes


class CudaGraphRunner:
    """The decode graphs of one model over one KV cache and request table, on ``device``."""

    def __init__(self, model: Model, kv_cache: KVCache, table: RequestTable, device: torch.device,
                 max_bs: int, pdl_for_size: Callable[[int], bool] = lambda bs: False,
                 log_progress: bool = True) -> None:
        """Captures a graph per size of `capture_sizes`, with PDL where ``pdl_for_size(size)``;
        ``log_progress``: log the capture's progress (`engine.common.progress`; TP rank 0 does)."""
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.sizes = capture_sizes(max_bs)
        self.inputs = {bs: DecodeBuffers(table, bs) for bs in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, ShardedLogits] = {}
        self.pdl_for_size = pdl_for_size
        self._capture_all(Progress("capturing CUDA graphs", len(self.sizes), "batch sizes", enabled=log_progress))

    @torch.inference_mode()
    def _capture_all(self, progress: Progress) -> None:
        pool = None
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            with pdl_mode(self.pdl_for_size(bs)):
                self.graphs[bs] = self._capture(bs, pool)
            pool = self.graphs[bs].pool()
            progress.advance()
        torch.cuda.synchronize(self.device)
        progress.finish()

    def _capture(self, bs: int, pool: Optional[tuple]) -> torch.cuda.CUDAGraph:
        """Size ``bs``'s graph (its output into ``outputs``), in memory pool ``pool`` (None: new)."""
        batch = self.inputs[bs].batch
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model(batch, self.kv_cache)  # warm-up: lazy inits, and the dispatch decision is cached
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs[bs] = self.model(batch, self.kv_cache)
        return graph

    def can_run(self, bs: int) -> bool:
        return bs <= self.sizes[-1]

    def replay(self, plan: StepPlan) -> tuple[ShardedLogits, torch.Tensor]:
        """``(the logits, the sequences' table rows [B])`` of a decode plan: views of the graph's
        static output and input buffers."""
        bs = plan.batch_size
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        self.inputs[padded].load(plan)
        self.graphs[padded].replay()
        return self.outputs[padded][:bs], self.inputs[padded].batch.row_ids[:bs]

    def destroy(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self.inputs.clear()
