"""gpt-oss's experts kernel (layers/moe/kernels/triton_mxfp4_moe.py) on one GPU at gpt-oss-20b
(32 experts) and gpt-oss-120b (128 experts) shapes: hidden 2880, intermediate 2880, top-4,
bf16 activations, MXFP4 weights kept (``--weights bf16`` for the bf16 form). Random weights
(MXFP4 bytes uniform, scales 2^-9 .. 2^-5; bf16 N(0, 0.02)), random biases and top-4 routing.

For each token count: µs per call, the median of 10 replays of a CUDA graph of CALLS calls,
each with its own routing, so consecutive calls mostly read other experts' weights (no L2
reuse from the call before); the weight bytes a call reads (its active experts' weights,
biases and scales, the mean over the CALLS routings); the time that takes at 4.8 TB/s and the
share of 4.8 TB/s reached; and, against `GptOssExperts.forward_torch` on the same weights, the
relative RMS error of the first call's output (bf16 roundings in another order: about 5e-3).

    python -m arfusion.benchmarks.kernels.bench_mxfp4_moe --tokens 1 8 32 128 512 --json out/bench_mxfp4_moe.json

``--tiles`` times other tiles too (each ``BLOCK_M,BN_GATE_UP,BK_GATE_UP,BN_DOWN,BK_DOWN,WARPS,STAGES``,
e.g. ``16,64,128,64,128,4,4``), one row per tile set after the default tiles' row ("default":
`experts_block_config`).
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

HBM_BYTES_PER_S = 4.8e12
MODELS = {"gpt-oss-20b": 32, "gpt-oss-120b": 128}  # experts; hidden = intermediate = 2880, top-4
HIDDEN = INTERMEDIATE = 2880
TOP_K = 4
CALLS = 8


def make_experts(num_experts: int, mxfp4: bool, seed: int):
    """A `GptOssExperts` on the current GPU with seeded random weights (module docstring)."""
    from arfusion.layers.moe.gpt_oss_moe import GptOssExperts

    torch.manual_seed(seed)
    experts = GptOssExperts(num_experts, HIDDEN, INTERMEDIATE, 1.702, 7.0, mxfp4, torch.bfloat16, torch.device("cuda"))
    with torch.no_grad():
        for name, p in experts.named_parameters():
            if name.endswith("blocks"):
                p.copy_(torch.randint(0, 256, p.shape, dtype=torch.uint8, device="cuda"))
            elif name.endswith("scales"):
                p.copy_(torch.randint(118, 123, p.shape, dtype=torch.uint8, device="cuda"))
            else:
                p.copy_(torch.randn(p.shape, device="cuda") * (0.02 if name.endswith("weight") else 0.1))
    return experts


def expert_bytes(experts) -> int:
    """Bytes of one expert's weights, scales and biases."""
    return sum(p[0].numel() * p.element_size() for p in experts.parameters())


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item()


def parse_tiles(text: str):
    """``"16,32,128,32,128,4,4"`` -> a `MoEBlockConfig` (fields in its order)."""
    from arfusion.layers.moe.kernels.triton_fused_moe import MoEBlockConfig

    values = [int(v) for v in text.split(",")]
    if len(values) != 7:
        raise argparse.ArgumentTypeError(f"--tiles needs 7 integers BLOCK_M,BN_GATE_UP,BK_GATE_UP,BN_DOWN,BK_DOWN,"
                                         f"WARPS,STAGES, got {text!r}")
    return MoEBlockConfig(*values)


def bench(experts, tokens: int, seed: int, config=None) -> dict:
    """One row: time, bytes, bandwidth share and error at ``tokens`` (module docstring), with the
    tiles ``config`` (a `MoEBlockConfig`; None: the kernel's default)."""
    from functools import partial

    from arfusion.layers.moe.kernels.triton_mxfp4_moe import experts_block_config
    from arfusion.layers.moe.kernels.triton_mxfp4_moe import gpt_oss_experts_triton as run

    gpt_oss_experts_triton = partial(run, config=config)

    g = torch.Generator(device="cuda").manual_seed(seed)
    e = experts.num_experts
    xs = [torch.randn(tokens, HIDDEN, generator=g, device="cuda").to(torch.bfloat16) for _ in range(CALLS)]
    ids = [torch.rand(tokens, e, generator=g, device="cuda").topk(TOP_K, dim=-1).indices.to(torch.int32)
           for _ in range(CALLS)]
    weights = [torch.softmax(torch.randn(tokens, TOP_K, generator=g, device="cuda"), -1) for _ in range(CALLS)]
    calls = list(zip(xs, weights, ids))
    first = gpt_oss_experts_triton(xs[0], experts, weights[0], ids[0])  # compiles outside the capture
    error = rel_rms(first, experts.forward_torch(xs[0], weights[0], ids[0]))
    for x, w, i in calls:
        gpt_oss_experts_triton(x, experts, w, i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, w, i in calls:
            gpt_oss_experts_triton(x, experts, w, i)
    graph.replay()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    us = statistics.median(times)
    active = statistics.mean(torch.unique(i).numel() for i in ids)
    nbytes = active * expert_bytes(experts)
    floor_us = nbytes / HBM_BYTES_PER_S * 1e6
    used = config or experts_block_config(tokens * TOP_K, experts.num_experts)
    return {"tokens": tokens, "tiles": "default" if config is None else "given", "config": used.__dict__, "us": us, "active_experts": active, "bytes": nbytes, "floor_us": floor_us,
            "bandwidth_share": floor_us / us, "rel_rms_error": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--weights", choices=("mxfp4", "bf16"), default="mxfp4")
    parser.add_argument("--tiles", type=parse_tiles, nargs="*", default=[],
                        help="more tile sets to time, each BLOCK_M,BN_GATE_UP,BK_GATE_UP,BN_DOWN,BK_DOWN,WARPS,STAGES")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mxfp4_moe needs a CUDA GPU")
    from arfusion.layers.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    init_tensor_parallel(1, 0, device=torch.device("cuda", 0))
    rows = []
    try:
        print(f"{'model':>13} {'weights':>7} {'tokens':>6} {'us':>9} {'experts':>7} {'MB read':>8} {'floor us':>8} "
              f"{'% 4.8TB/s':>9} {'rel rms':>8}  tiles (m, n/k gate_up, n/k down, warps, stages)")
        for model in args.models:
            experts = make_experts(MODELS[model], args.weights == "mxfp4", seed=0)
            for tokens in args.tokens:
                for config in [None, *args.tiles]:
                    row = {"model": model, "weights": args.weights, **bench(experts, tokens, tokens, config)}
                    rows.append(row)
                    print(f"{model:>13} {args.weights:>7} {tokens:>6} {row['us']:>9.1f} {row['active_experts']:>7.1f} "
                          f"{row['bytes'] / 1e6:>8.1f} {row['floor_us']:>8.1f} {100 * row['bandwidth_share']:>8.1f}% "
                          f"{row['rel_rms_error']:>8.1e}  {row['tiles']} {tuple(row['config'].values())}", flush=True)
            del experts
            torch.cuda.empty_cache()
    finally:
        destroy_tensor_parallel()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
