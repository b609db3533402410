"""Decode steps as CUDA graphs, one per padded batch size.

The batch's tensors live in static buffers; a step copies the plan into them and replays the
graph of the smallest captured size >= its batch. Padding rows point at the padding row of
the request table (all slot 0, the scratch slot) with length 1, so they compute something
harmless. The fusion workspace is reserved for the largest size before the first capture,
and capture runs each forward once, so every dispatch decision is made (and cached) there.
"""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.step_plan import StepPlan

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class CudaGraphRunner:
    def __init__(self, runner: "ModelRunner", max_bs: int) -> None:
        self.runner = runner
        self.sizes = [bs for bs in CAPTURE_SIZES if bs <= max_bs]
        if not self.sizes or self.sizes[-1] < max_bs:
            self.sizes.append(max_bs)
        dev, width, biggest = runner.device, runner.context_len, self.sizes[-1]
        self.input_ids = torch.zeros(biggest, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(biggest, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(biggest, dtype=torch.int64, device=dev)
        self.extend_lens = torch.ones(biggest, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(biggest, dtype=torch.int64, device=dev)
        self.req_to_token = torch.zeros(biggest, width, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        runner.fusion.reserve(biggest)
        self._capture_all()

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(ForwardMode.DECODE, self.input_ids[:bs], self.positions[:bs], self.seq_lens[:bs],
                            self.extend_lens[:bs], self.slot_mapping[:bs], self.req_to_token[:bs])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        model, kv = self.runner.model, self.runner.kv_cache
        pool = None
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            batch = self._batch(bs)
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

    def replay(self, plan: StepPlan) -> torch.Tensor:
        bs = plan.batch_size
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        table = self.runner.table
        batch = table.apply(plan, width=table.context_len)
        self.input_ids[:bs].copy_(batch.input_ids)
        self.positions[:bs].copy_(batch.positions)
        self.seq_lens[:bs].copy_(batch.seq_lens)
        self.slot_mapping[:bs].copy_(batch.slot_mapping)
        self.req_to_token[:bs].copy_(batch.req_to_token)
        if padded > bs:
            self.seq_lens[bs:padded].fill_(1)
            self.slot_mapping[bs:padded].zero_()
            self.positions[bs:padded].zero_()
            self.input_ids[bs:padded].zero_()
            self.req_to_token[bs:padded].zero_()
        self.graphs[padded].replay()
        return self.outputs[padded][:bs]

    def destroy(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
