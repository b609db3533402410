"""Decode steps as CUDA graphs, one per padded batch size.

Each size's graph reads its `DecodeBuffers`: one packed static buffer of the step's integers
(input_ids, positions, seq_lens, slot_mapping, row ids) and the runner's whole request table,
which attention reads through the row ids. A step picks the smallest captured size >= its
batch, refills that buffer with one host-to-device copy, records the new slots in the table
(one index_put) and replays the graph. Padding rows point at the padding row of the request
table (all slot 0, the scratch slot) with length 1, so they compute something harmless. The
fusion workspace is reserved for the largest size before the first capture, and capture runs
each forward once, so every dispatch decision is made (and cached) there.
"""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

from engine.step_plan import DecodeBuffers, StepPlan
from layers.sharded_logits import ShardedLogits

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class CudaGraphRunner:
    def __init__(self, runner: "ModelRunner", max_bs: int) -> None:
        self.runner = runner
        self.sizes = [bs for bs in CAPTURE_SIZES if bs <= max_bs]
        if not self.sizes or self.sizes[-1] < max_bs:
            self.sizes.append(max_bs)
        self.inputs = {bs: DecodeBuffers(runner.table, bs) for bs in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, ShardedLogits] = {}
        runner.fusion.reserve(self.sizes[-1])
        self._capture_all()

    @torch.inference_mode()
    def _capture_all(self) -> None:
        model, kv = self.runner.model, self.runner.kv_cache
        pool = None
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            batch = self.inputs[bs].batch
            stream = torch.cuda.Stream(self.runner.device)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    model(batch, kv)  # warm-up: lazy inits, and the dispatch decision is cached
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = model(batch, kv)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.runner.device)

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
