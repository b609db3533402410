"""gpt-oss's experts kernel (layers/moe/kernels/triton_mxfp4_moe.py) on one GPU at gpt-oss-20b
(32 experts) and gpt-oss-120b (128 experts) shapes: hidden 2880, intermediate 2880, top-4,
bf16 activations, MXFP4 weights kept (``--weights bf16`` for the bf16 form). Random weights
(MXFP4 bytes uniform, scales 2^-9 .. 2^-5; bf16 N(0, 0.02)), random biases and top-4 routing.

For each token count and each configuration (the default, `triton_mxfp4_moe.default_config`,
first): µs per call, the median of 10 replays of a CUDA graph of CALLS calls, each with its own
routing, so consecutive calls mostly read other experts' weights (no L2 reuse from the call
before); the weight bytes a call reads (its active experts' weights, biases and scales, the mean
over the CALLS routings); the time that takes at 4.8 TB/s and the share of 4.8 TB/s reached; the
speed-up over the default; against `GptOssExperts.forward_torch` on the same weights, the relative
RMS error of the first call's output (bf16 roundings in another order: about 5e-3); and whether
two eager calls gave the same bits ("det"). A configuration that fails to compile or run prints
its error in its row and the run goes on.

    python -m arfusion.benchmarks.kernels.bench_mxfp4_moe --tokens 1 8 32 128 512 --out out/bench_mxfp4_moe.json

``--configs`` times other configurations too, each a comma-separated list of `Mxfp4MoEConfig`
fields that replace the default's at each token count (from `TENSOR_CORE_MIN_SLOTS` slots the
tensor-core launches' tiles, below them the matrix-vector launches'), e.g. ``block_m=16`` or ``prefetch=1`` for the
tensor-core launches, ``tensor_cores=0,swap=1,word_decode=1,block_m=8`` for the grouped ones, or
``tensor_cores=0,block_n_down=64,split_k_down=2,num_stages=4`` (booleans as 0 / 1; every field of
`Mxfp4MoEConfig`: tiles, K steps, warps and stages of either launch, K splits of the down
projection). A configuration the default's launches cannot take prints its refusal in its row.
``--sweep`` adds this file's candidate list (`sweep_candidates`: the variants by token count)
after them. ``--profile`` prints under each row its launches (align, gate/up, down, combine, ...)
with their GPU µs per call, from the torch profiler's records of the graph's replays.

Time: each configuration compiles its gate/up and down launches for each token count whose
slot count differs in divisibility by 16 (triton specialises integer arguments on it), seconds
each, then makes about a hundred calls; the replays themselves take milliseconds.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from arfusion.benchmarks.kernels.graph_timing import kernel_us_per_op
from arfusion.benchmarks.kernels.rows_file import write_rows
from arfusion.fusion.tuning.timing import median_replay_us

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


def parse_overrides(text: str) -> dict:
    """``"swap=1,block_m=8"`` -> ``{"swap": True, "block_m": 8}`` (`Mxfp4MoEConfig` fields)."""
    from arfusion.layers.moe.kernels.mxfp4_moe_config import Mxfp4MoEConfig

    fields = {f.name: f.type for f in dataclasses.fields(Mxfp4MoEConfig)}
    overrides = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in fields or not value:
            raise argparse.ArgumentTypeError(f"{item!r}: need NAME=VALUE with NAME one of {sorted(fields)}")
        overrides[name] = bool(int(value)) if fields[name] in (bool, "bool") else int(value)
    return overrides


def sweep_candidates(tokens: int) -> list[dict]:
    """The variants ``--sweep`` times at ``tokens`` (overrides of the default, module docstring):
    the weight as the left operand (swap) with the word decoder over token blocks near the rows
    per expert, row tiles matched to the warps (16 rows a warp), K steps of 128 .. 512, K splits
    of the down projection; the word decoder alone in the default orientation; the swap alone."""
    rows = tokens * TOP_K / MODELS["gpt-oss-20b"]
    block_m = min(64, max(8, 1 << max(0, (int(rows) - 1).bit_length())))
    swap = dict(swap=True, word_decode=True, block_m=block_m)
    tiles = [(16, 256, 1, 3, 1), (32, 256, 2, 3, 1), (64, 256, 4, 3, 1), (32, 128, 2, 4, 1), (64, 128, 4, 4, 1),
             (32, 512, 2, 2, 1), (64, 512, 4, 2, 1), (32, 256, 2, 3, 2), (64, 256, 4, 3, 2), (128, 256, 8, 3, 1)]
    if rows > 4:  # several tokens per expert: fewer, wider candidates
        tiles = [(64, 256, 4, 3, 1), (64, 128, 4, 4, 1), (128, 128, 8, 3, 1), (128, 256, 8, 3, 1)]
    out = [dict(swap, block_n_gate_up=n, block_k_gate_up=k, block_n_down=n, block_k_down=k, num_warps=w,
                num_stages=s, split_k_down=split) for n, k, w, s, split in tiles]
    if rows <= 4:
        out.append(dict(swap, block_m=1, block_n_gate_up=32, block_k_gate_up=256, block_n_down=32, block_k_down=256,
                        num_warps=2, num_stages=3))
    out.append(dict(word_decode=True))
    out.append(dict(swap=True, block_m=block_m))
    return out


def bench(experts, tokens: int, seed: int, configs: list, profile: bool = False) -> list[dict]:
    """Rows at ``tokens`` (module docstring), one per configuration in ``configs`` (None: the
    kernel's default; else a `Mxfp4MoEConfig`), on the same inputs; with ``profile`` each row
    also has ``kernels``: µs per call of each of its launches (`kernel_us_per_op`)."""
    from arfusion.layers.moe.kernels.triton_mxfp4_moe import default_config, gpt_oss_experts_triton

    g = torch.Generator(device="cuda").manual_seed(seed)
    e = experts.num_experts
    xs = [torch.randn(tokens, HIDDEN, generator=g, device="cuda").to(torch.bfloat16) for _ in range(CALLS)]
    ids = [torch.rand(tokens, e, generator=g, device="cuda").topk(TOP_K, dim=-1).indices.to(torch.int32)
           for _ in range(CALLS)]
    weights = [torch.softmax(torch.randn(tokens, TOP_K, generator=g, device="cuda"), -1) for _ in range(CALLS)]
    calls = list(zip(xs, weights, ids))
    reference = experts.forward_torch(xs[0], weights[0], ids[0])
    active = statistics.mean(torch.unique(i).numel() for i in ids)
    nbytes = active * expert_bytes(experts)
    floor_us = nbytes / HBM_BYTES_PER_S * 1e6
    rows = []
    for config in configs:
        used = config or default_config(experts, tokens * TOP_K, xs[0].dtype)
        row = {"tokens": tokens, "default": config is None, "config": dataclasses.asdict(used),
               "active_experts": active, "bytes": nbytes, "floor_us": floor_us}
        try:
            first = gpt_oss_experts_triton(xs[0], experts, weights[0], ids[0], config)  # compiles outside the capture
            again = gpt_oss_experts_triton(xs[0], experts, weights[0], ids[0], config)
            row["rel_rms_error"] = rel_rms(first, reference)
            row["deterministic"] = bool(torch.equal(first, again))
            for x, w, i in calls:
                gpt_oss_experts_triton(x, experts, w, i, config)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for x, w, i in calls:
                    gpt_oss_experts_triton(x, experts, w, i, config)
            graph.replay()
            row["us"] = median_replay_us(graph, CALLS)
            row["bandwidth_share"] = floor_us / row["us"]
            if profile:
                row["kernels"] = kernel_us_per_op(graph, CALLS)
            del graph
        except Exception as exc:  # a candidate that does not compile or run: its row says why
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
            torch.cuda.synchronize()
        rows.append(row)
    return rows


def describe(row: dict) -> str:
    """A row's configuration in one short line: "default", or its fields that differ from the
    default's."""
    if row["default"]:
        return "default"
    if not row["changed"]:
        return "(the default's fields)"
    short = {"block_m": "m", "block_n_gate_up": "n13", "block_k_gate_up": "k13", "block_n_down": "n2",
             "block_k_down": "k2", "num_warps": "w", "num_stages": "st", "swap": "swap", "word_decode": "word",
             "split_k_down": "split", "num_warps_down": "w2", "num_stages_down": "st2", "gemv": "gemv",
             "tensor_cores": "tc", "prefetch": "pre", "early_weights": "early"}
    return " ".join(f"{short[k]}={int(v)}" for k, v in row["changed"].items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--weights", choices=("mxfp4", "bf16"), default="mxfp4")
    parser.add_argument("--configs", type=parse_overrides, nargs="*", default=[],
                        help="more configurations to time, each NAME=VALUE,... of Mxfp4MoEConfig fields over the "
                             "default's")
    parser.add_argument("--sweep", action="store_true", help="also time the candidate list (sweep_candidates)")
    parser.add_argument("--profile", action="store_true",
                        help="also print each configuration's launches with their GPU µs per call (torch profiler)")
    parser.add_argument("--out", default=None, help="write every row to this JSON file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mxfp4_moe needs a CUDA GPU")
    from arfusion.layers.moe.kernels.triton_mxfp4_moe import default_config
    from arfusion.layers.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    init_tensor_parallel(1, 0, device=torch.device("cuda", 0))
    rows = []
    try:
        print(f"{'model':>13} {'weights':>7} {'tokens':>6} {'us':>8} {'x dflt':>6} {'% 4.8TB/s':>9} {'floor us':>8} "
              f"{'MB read':>7} {'rel rms':>8} {'det':>3}  config (fields changed from the default)")
        for model in args.models:
            experts = make_experts(MODELS[model], args.weights == "mxfp4", seed=0)
            for tokens in args.tokens:
                base = default_config(experts, tokens * TOP_K, torch.bfloat16)
                overrides = list(args.configs) + (sweep_candidates(tokens) if args.sweep else [])
                configs = [None] + [dataclasses.replace(base, **o) for o in overrides]
                default_us = None
                for row in bench(experts, tokens, tokens, configs, args.profile):
                    row = {"model": model, "weights": args.weights, **row}
                    row["changed"] = {k: v for k, v in row["config"].items() if getattr(base, k) != v}
                    rows.append(row)
                    label = describe(row)
                    if "error" in row:
                        print(f"{model:>13} {args.weights:>7} {tokens:>6} {'failed':>8}  {label}: {row['error']}",
                              flush=True)
                        continue
                    default_us = default_us or row["us"]
                    print(f"{model:>13} {args.weights:>7} {tokens:>6} {row['us']:>8.1f} {default_us / row['us']:>6.2f} "
                          f"{100 * row['bandwidth_share']:>8.1f}% {row['floor_us']:>8.1f} {row['bytes'] / 1e6:>7.1f} "
                          f"{row['rel_rms_error']:>8.1e} {'yes' if row['deterministic'] else 'NO':>3}  {label}",
                          flush=True)
                    for name, us in row.get("kernels", {}).items():
                        print(f"{'':>13} {us:8.1f} us  {name}", flush=True)
                best = min((r for r in rows if r["model"] == model and r["tokens"] == tokens and "us" in r),
                           key=lambda r: r["us"])
                print(f"{'':>13} best at {tokens} tokens: {best['us']:.1f} us, "
                      f"{100 * best['bandwidth_share']:.1f}% of 4.8 TB/s: {describe(best)}",
                      flush=True)
            del experts
            torch.cuda.empty_cache()
    finally:
        destroy_tensor_parallel()
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
