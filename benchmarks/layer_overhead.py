"""The Python a decoder layer's reductions cost, over a stack of layers at TP ``tp`` on CPU
(gloo), fusion on with the torch backend (what `bench_dispatch_overhead --layers N --tp T`
reports).

Per layer, as `engine.models.block_decoder` runs it: the input norm (the previous layer's
deferred reduction fused into it), the attention output as a `fusion.PartialSum` into the
post-attention norm, and the MLP output as a `PartialSum` handed on; then the final norm. The
layers pass their normed output on unchanged: no attention or MLP, only the reductions.

    calls per layer   Python function calls into fusion/ (nested ones too), counted with
                      sys.setprofile over one forward after a warm-up forward
    µs per layer      wall time of a forward / layers, with the collective replaced by a no-op
                      (``torch.distributed.all_reduce``, which every strategy's all-reduce
                      reaches): what remains is the Python of the norms and the fusion op and
                      the norm math's torch ops on [tokens, 64] fp32 rows (median and minimum
                      of repeats of 100 forwards)
"""
from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from arfusion import fusion
from arfusion.fusion import AllReduceFusion, FusionConfig, PartialSum
from arfusion.layers.layernorm import RMSNorm

FUSION_DIR = str(Path(fusion.__file__).parent)
HIDDEN, EPS = 64, 1e-6


def build_stack(layers: int) -> list[tuple[RMSNorm, RMSNorm]]:
    """Each layer's (input norm, post-attention norm)."""
    return [(RMSNorm(HIDDEN, EPS), RMSNorm(HIDDEN, EPS)) for _ in range(layers)]


def forward(op: AllReduceFusion, stack: list[tuple[RMSNorm, RMSNorm]], final_norm: RMSNorm,
            x: torch.Tensor) -> torch.Tensor:
    """Every layer's norms over its partial sums, then the final norm."""
    h: Any = x
    residual: torch.Tensor | None = None
    for i, (input_layernorm, post_attention_layernorm) in enumerate(stack):
        if residual is None:
            h, residual = input_layernorm(h), h
        else:
            h, residual = input_layernorm(h, residual)
        h, residual = post_attention_layernorm(PartialSum(pending=h, layer_id=i, op=op), residual)
        h = PartialSum(pending=h, layer_id=i, op=op)
    return final_norm(h, residual)[0]


def count_fusion_calls(step: Callable[[], Any]) -> int:
    """Python function calls whose code lives in fusion/ during ``step()``."""
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(FUSION_DIR):
            calls += 1

    import sys

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


def _no_op_collective() -> None:
    """Replace the device all-reduce (in place) by a no-op: ``x`` keeps this rank's values."""
    import torch.distributed as dist

    dist.all_reduce = lambda tensor, *args, **kwargs: None


def _worker(rank: int, tp: int, port: int, layers: int, tokens: int, repeats: int, out: Any) -> None:
    from arfusion.layers.parallel_state import (
        destroy_tensor_parallel,
        get_tp_group,
        init_tensor_parallel,
    )

    torch.set_num_threads(1)
    init_tensor_parallel(tp, rank, f"tcp://127.0.0.1:{port}", device=torch.device("cpu"), timeout_s=60)
    try:
        with torch.inference_mode():
            op = AllReduceFusion(get_tp_group(), FusionConfig(enabled=True, backend="torch", max_tokens=64),
                                 HIDDEN, torch.float32)
            op.setup()
            stack, final_norm = build_stack(layers), RMSNorm(HIDDEN, EPS)
            x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(0))
            forward(op, stack, final_norm, x.clone())  # warm-up: the decisions are cached
            calls = count_fusion_calls(lambda: forward(op, stack, final_norm, x.clone()))
            _no_op_collective()
            samples = []
            for _ in range(repeats):
                inputs = [x.clone() for _ in range(100)]
                start = time.perf_counter()
                for inp in inputs:
                    forward(op, stack, final_norm, inp)
                samples.append((time.perf_counter() - start) / len(inputs))
            if rank == 0:
                out.put({"layers": layers, "tp": tp, "tokens": tokens, "calls_per_layer": calls / layers,
                         "us_per_layer": statistics.median(samples) * 1e6 / layers,
                         "us_per_layer_min": min(samples) * 1e6 / layers})
            op.destroy()
    finally:
        destroy_tensor_parallel()


def measure(layers: int = 8, tp: int = 2, tokens: int = 4, repeats: int = 21) -> dict[str, float]:
    """Spawns ``tp`` ranks; rank 0's numbers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [ctx.Process(target=_worker, args=(r, tp, port, layers, tokens, repeats, out)) for r in range(tp)]
    for p in procs:
        p.start()
    result = out.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return result
