"""GPU side of `benchmark_fused_collective`: the timed paths, their CUDA-graph timing, and
the rank votes that let a failing path be skipped by every rank together.

Every path computes, over the TP group,

    s      = sum over ranks of x                 (x: this rank's [tokens, hidden] partial sum)
    normed = rms_norm(s + residual) * weight     (s alone without a residual)
    out    = normed | fp8(normed / scale) | nvfp4(normed, global scale)

and returns ``out``. Paths consume their inputs (the standard ones reduce and normalise in
place), so every correctness check runs on fresh copies; timed replays reuse one pair of
buffers, whose values may drift over replays (no kernel's time depends on them).
"""
from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from arfusion import fusion
from arfusion.fusion import norm, reference
from arfusion.fusion.backends.base import Made
from arfusion.fusion.group import TensorParallelGroup
from arfusion.fusion.strategies import REGISTRY

EPS = 1e-6
FP8_SCALE = 8.0 / 448.0  # |normed| stays below ~6 for these inputs: fp8 values below ~340
FP4_GLOBAL_SCALE = 448.0 * 6.0 / 8.0  # nvfp4 convention: e4m3 max * e2m1 max / amax
MAX_ERROR_CHARS = 300
# arfusion's own strategies made on demand (over symmetric memory: `fusion.strategies.REGISTRY`), each a
# row where its buffer holds the batch
OWN_STRATEGY_PATHS = {cls.strategy: f"{cls.strategy.value}_allreduce_rmsnorm" for cls in REGISTRY
                      if cls.made is Made.ON_DEMAND}

Op = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass
class Inputs:
    """One configuration's inputs on this rank (random, never zeros) and the fp32 reference."""

    x: torch.Tensor  # this rank's partial sum
    residual: torch.Tensor | None  # identical on every rank
    weight: torch.Tensor  # identical on every rank
    scale: torch.Tensor  # fp32 [1]: the static FP8 scale or the FP4 global scale
    reference: torch.Tensor  # fp32 rms_norm(all-reduced fp32 sum + residual) * weight


@dataclass
class Path:
    name: str
    op: Op | None
    error: str | None = None  # why op is None (identical on every rank)


class FusedResources:
    """For one (hidden, dtype): the workspace of the direct fused paths and the dispatcher's
    own `AllReduceFusion`. Collective to create and to `destroy`."""

    def __init__(self, group: TensorParallelGroup, max_tokens: int, hidden: int, dtype: torch.dtype, enabled: bool,
                 launch_with_pdl: bool = True, table_path: str | None = None):
        self.launch_with_pdl = launch_with_pdl
        self.workspace = fusion.AllReduceFusionWorkspace(group)
        self.fusion_op: fusion.AllReduceFusion | None = None
        if enabled:
            self.workspace.ensure(max_tokens, hidden, dtype)
            # the dispatch as a server decides it, less start-up tuning: the packaged or given
            # table, else the built-in rule ("none": the rule alone)
            config = fusion.FusionConfig(enabled=True, backend="flashinfer", max_tokens=max_tokens,
                                         launch_with_pdl=launch_with_pdl, table_path=table_path, tune_at_startup=False)
            self.fusion_op = fusion.AllReduceFusion(group, config, hidden, dtype)
            self.fusion_op.setup()
            self.fusion_op.ensure_all(max_tokens)  # each voted: ready on every rank or on none

    def destroy(self) -> None:
        if self.fusion_op is not None:
            self.fusion_op.destroy()
        self.workspace.destroy()


def make_inputs(group: TensorParallelGroup, tokens: int, hidden: int, dtype: torch.dtype, with_residual: bool,
                quant: str, seed: int) -> Inputs:
    """Seeded inputs; the reference all-reduces this rank's (rounded) x in fp32 over the group."""
    dev = group.device
    local = torch.Generator(device=dev).manual_seed(seed * 1000 + group.rank)
    shared = torch.Generator(device=dev).manual_seed(seed * 1000 + 999)
    x = torch.randn(tokens, hidden, generator=local, device=dev).to(dtype)
    residual = torch.randn(tokens, hidden, generator=shared, device=dev).to(dtype) if with_residual else None
    weight = (1.0 + 0.1 * torch.randn(hidden, generator=shared, device=dev)).to(dtype)
    scale = torch.tensor([FP4_GLOBAL_SCALE if quant == "fp4" else FP8_SCALE], dtype=torch.float32, device=dev)
    summed = group.all_reduce(x.float())
    ref, _ = reference.add_rms_norm(summed, None if residual is None else residual.float(), weight.float(), EPS)
    return Inputs(x, residual, weight, scale, ref)


def fresh(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    return inputs.x.clone(), None if inputs.residual is None else inputs.residual.clone()


def _quantize(normed: torch.Tensor, quant: str, scale: torch.Tensor) -> torch.Tensor:
    if quant == "fp8":
        return reference.quantize_fp8_static(normed, scale)
    if quant == "fp4":
        import flashinfer

        return flashinfer.fp4_quantize(normed, scale)[0]
    return normed


def _standard(group: TensorParallelGroup, quant: str, inputs: Inputs) -> Op:
    """NCCL all-reduce (torch.distributed, device group) + flashinfer's in-place (fused_add_)
    rmsnorm, + a separate quantization. torch's norm where flashinfer's kernels do not apply
    (float32, or no flashinfer)."""
    weight, scale = inputs.weight, inputs.scale

    def op(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        group.all_reduce(x)
        return _quantize(norm.add_rms_norm(x, residual, weight, EPS)[0], quant, scale)

    return op


def _native_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return reference.add_rms_norm(x, residual, weight, eps)[0]


def _native_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     scale: torch.Tensor) -> torch.Tensor:
    return reference.quantize_fp8_static(_native_norm(x, residual, weight, eps), scale)


@functools.cache
def _compiled(quant: str) -> Callable[..., torch.Tensor]:
    import torch._dynamo

    # Several hidden sizes, dtypes and residual modes recompile the same function.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(_native_norm_fp8 if quant == "fp8" else _native_norm)


def _native_compiled(group: TensorParallelGroup, quant: str, inputs: Inputs) -> Op:
    """Eager NCCL all-reduce, then torch.compile of the plain-torch add + RMSNorm (+ FP8).

    Only the add + RMSNorm part is compiled: dynamo rewrites an in-place c10d all_reduce into
    a functional collective (own output buffer, explicit wait), which on a non-default process
    group inside CUDA-graph capture is fragile across torch versions; the NCCL kernel is the
    same either way, and the compiler's job here is fusing the elementwise + reduction part.
    """
    compiled = _compiled(quant)
    weight, scale = inputs.weight, inputs.scale

    def op(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        group.all_reduce(x)
        if quant == "fp8":
            return compiled(x, residual, weight, EPS, scale)
        return compiled(x, residual, weight, EPS)

    return op


def _fused(group: TensorParallelGroup, quant: str, inputs: Inputs, workspace: fusion.AllReduceFusionWorkspace,
           one_shot: bool, pdl: bool) -> Op:
    """arfusion's public op with an explicit flashinfer strategy over our workspace."""
    weight = inputs.weight
    strategy = fusion.Strategy.FLASHINFER_ONE_SHOT if one_shot else fusion.Strategy.FLASHINFER_TWO_SHOT
    q = None if quant == "none" else fusion.Quant(quant, inputs.scale)
    return lambda x, r: fusion.all_reduce_add_rms_norm(x, r, weight, EPS, group=group, strategy=strategy,
                                                       workspace=workspace, quant=q, launch_with_pdl=pdl).normed


def _raw_oneshot(quant: str, inputs: Inputs, handle: Any, pdl: bool) -> Op:
    """flashinfer.comm.allreduce_fusion called directly, one-shot, outputs preallocated once
    (the same calls arfusion makes, without its checks and per-call allocations)."""
    import flashinfer.comm as fi_comm
    import flashinfer.norm as fi_norm

    pattern = fi_comm.AllReduceFusionPattern
    weight = inputs.weight
    norm_out, residual_out = torch.empty_like(inputs.x), torch.empty_like(inputs.x)
    quant_out = torch.empty_like(inputs.x, dtype=torch.float8_e4m3fn) if quant == "fp8" else None
    kw = {"workspace": handle, "launch_with_pdl": pdl, "trigger_completion_at_end": True, "use_oneshot": True}

    def no_residual(x: torch.Tensor, _: torch.Tensor | None) -> torch.Tensor:
        fi_comm.allreduce_fusion(input=x, pattern=pattern.kAllReduce, output=residual_out, **kw)
        return fi_norm.rmsnorm(residual_out, weight, EPS, out=norm_out)

    def residual_norm(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        fi_comm.allreduce_fusion(
            input=x, pattern=pattern.kARResidualRMSNorm, output=norm_out, residual_in=residual,
            residual_out=residual_out, norm_out=norm_out, rms_gamma=weight, rms_eps=EPS, **kw,
        )
        return norm_out

    def residual_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        fi_comm.allreduce_fusion(
            input=x, pattern=pattern.kARResidualRMSNormFP8Quant, output=residual_out, residual_in=residual,
            residual_out=residual_out, quant_out=quant_out, rms_gamma=weight, rms_eps=EPS,
            scale_factor=inputs.scale, **kw,
        )
        return quant_out

    if inputs.residual is None:
        return no_residual
    return residual_norm_fp8 if quant == "fp8" else residual_norm


def build_paths(group: TensorParallelGroup, quant: str, inputs: Inputs, res: FusedResources,
                disable_oneshot: bool) -> tuple[list[Path], list[str]]:
    """The paths that apply to this configuration, and notes on those left out."""
    tokens = inputs.x.shape[0]
    # ranks sharing a GPU reduce over gloo, which copies through the host: not capturable
    uncapturable = "gloo (TP ranks sharing a GPU) cannot run in a CUDA graph" if group.shares_gpu else None

    def standard(name: str, make: Callable[[], Op]) -> Path:
        return Path(name, None, uncapturable) if uncapturable else Path(name, make())

    paths = [standard("standard_allreduce_rmsnorm", lambda: _standard(group, quant, inputs))]
    if quant != "fp4":  # no plain-torch NVFP4 (swizzled block scales) to compile
        paths.append(standard("standard_allreduce_rmsnorm_native_compiled", lambda: _native_compiled(group, quant, inputs)))
    if res.fusion_op is None:
        return paths, []
    if quant != "none" and inputs.residual is None:
        return paths, ["fused paths skipped: the fused quantized patterns need a residual"]
    ws = res.workspace
    missing = None if ws.ready else f"no fusion workspace ({ws.failure})"

    def fused(name: str, make: Callable[[], Op]) -> Path:
        return Path(name, None, missing) if missing else Path(name, make())

    if not disable_oneshot:
        paths.append(fused("flashinfer_fused_allreduce_rmsnorm_oneshot", lambda: _fused(group, quant, inputs, ws, True, res.launch_with_pdl)))
    if tokens > group.world_size:
        paths.append(fused("flashinfer_fused_allreduce_rmsnorm_twoshot", lambda: _fused(group, quant, inputs, ws, False, res.launch_with_pdl)))
    if not disable_oneshot and quant != "fp4":
        paths.append(fused("flashinfer_raw_oneshot", lambda: _raw_oneshot(quant, inputs, ws.handle, res.launch_with_pdl)))
    notes = []
    op = res.fusion_op
    for strategy, name in OWN_STRATEGY_PATHS.items():
        if quant == "none" and op.backends[strategy].fits(tokens):
            paths.append(Path(name, lambda x, r, s=strategy: op.run(s, x, r, inputs.weight, EPS).normed))
    if quant == "none":
        why = op.plan.why_not(0, tokens)
        chosen = op.strategy(0, tokens)
        notes.append(f"arfusion_dispatch chose {chosen}" + (f" ({why})" if why else ""))
        # what a layer runs: the cached decision for (layer 0, tokens), then its strategy
        def dispatch(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
            return op.reduce_add_rms_norm(fusion.PartialSum(pending=x, layer_id=0, op=op), r, inputs.weight, EPS)[0]

        paths.append(Path("arfusion_dispatch", None, uncapturable) if uncapturable and chosen is fusion.Strategy.NCCL
                     else Path("arfusion_dispatch", dispatch))
    return paths, notes


def one_line(exc: BaseException) -> str:
    text = " / ".join(line.strip() for line in f"{type(exc).__name__}: {exc}".splitlines() if line.strip())
    return text[:MAX_ERROR_CHARS]


def voted(group: TensorParallelGroup, step: Callable[[], Any]) -> tuple[str | None, list[Any]]:
    """Run ``step`` (then synchronise the GPU) on every rank and agree over the CPU group:
    ``(first failing rank's error or None, every rank's return value)``."""
    try:
        value, error = step(), None
        torch.cuda.synchronize(group.device)
    except Exception as exc:  # noqa: BLE001 (a rank-local failure must reach the other ranks)
        value, error = None, one_line(exc)
    gathered = group.all_gather_object((error, value))
    errors = [f"rank {r}: {e}" for r, (e, _) in enumerate(gathered) if e]
    return (errors[0] if errors else None), [v for _, v in gathered]


def rel_l2_error(op: Op, inputs: Inputs, quant: str) -> float | None:
    """``||out - ref|| / ||ref||`` of one eager call on fresh inputs (FP8 dequantised with its
    scale); None for FP4, whose swizzled block scales are not dequantised here."""
    out = op(*fresh(inputs))
    if quant == "fp4":
        return None
    got = out.float() * inputs.scale if quant == "fp8" else out.float()
    return (torch.linalg.vector_norm(got - inputs.reference) / torch.linalg.vector_norm(inputs.reference)).item()


def capture(op: Op, x: torch.Tensor, residual: torch.Tensor | None, ops_per_graph: int) -> torch.cuda.CUDAGraph:
    """One eager call on a side stream (NCCL, flashinfer and compiled kernels warm), then
    ``ops_per_graph`` calls captured into one graph."""
    side = torch.cuda.Stream(device=x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        op(x, residual)
    torch.cuda.current_stream(x.device).wait_stream(side)
    torch.cuda.synchronize(x.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(ops_per_graph):
            op(x, residual)
    return graph


def interleaved_median_ms(graphs: list[torch.cuda.CUDAGraph], warmup: int, trials: int) -> list[float]:
    """Per graph, the median over ``trials`` timed replays (CUDA events) after ``warmup``
    untimed ones. Trials go round-robin over the graphs, so clock and thermal drift during the
    run hits every path alike (paths timed one after another differed by up to 4% at 4 µs)."""
    for graph in graphs:
        for _ in range(warmup):
            graph.replay()
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in graphs]
              for _ in range(trials)]
    for trial in events:
        for graph, (start, end) in zip(graphs, trial):
            start.record()
            graph.replay()
            end.record()
    torch.cuda.synchronize()
    return [statistics.median(trial[i][0].elapsed_time(trial[i][1]) for trial in events) for i in range(len(graphs))]


def run_paths(group: TensorParallelGroup, paths: list[Path], inputs: Inputs, quant: str, ops_per_graph: int,
              warmup: int, trials: int) -> list[dict[str, Any]]:
    """Check and capture every path on every rank (a failure in either on any rank drops that
    path on all ranks), then time the captured ones side by side (`interleaved_median_ms`).
    Returns one dict of `PathResult` fields per path, in order; ends with a barrier."""
    results: list[dict[str, Any]] = []
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    buffers: dict[int, tuple] = {}  # a graph reads and writes the tensors it was captured on: keep them alive
    for i, path in enumerate(paths):
        result: dict[str, Any] = {"name": path.name}
        results.append(result)
        if path.op is None:
            result["error"] = path.error
            continue
        op = path.op
        error, errors_l2 = voted(group, lambda op=op: rel_l2_error(op, inputs, quant))
        if error is None:
            buffers[i] = fresh(inputs)
            error, _ = voted(group, lambda i=i, op=op: graphs.__setitem__(i, capture(op, *buffers[i], ops_per_graph)))
        if error is not None:
            result["error"] = error
            graphs.pop(i, None)
            buffers.pop(i, None)
            continue
        finite = [e for e in errors_l2 if e is not None]
        result["rel_l2_error"] = max(finite) if finite else None
    order = sorted(graphs)
    error, per_rank = voted(group, lambda: [ms / ops_per_graph for ms in
                                            interleaved_median_ms([graphs[i] for i in order], warmup, trials)])
    for k, i in enumerate(order):
        if error is None:
            times = [rank_times[k] for rank_times in per_rank]
            results[i].update(time_ms=max(times), time_ms_per_rank=times)
        else:
            results[i]["error"] = error
    graphs.clear()
    buffers.clear()
    dist.barrier(group=group.cpu_group)
    return results
