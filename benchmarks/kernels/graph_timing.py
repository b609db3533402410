"""The GPU time of each kernel of a captured CUDA graph per operation (the median time of a whole
replay is `fusion.tuning.timing.median_replay_us`)."""
import torch


def kernel_us_per_op(graph: torch.cuda.CUDAGraph, ops_per_replay: int, replays: int = 3) -> dict[str, float]:
    """GPU time of each kernel of ``graph`` (by name, the profiler's CUPTI records of the replayed
    kernels), summed over ``replays`` replays and divided by ``replays * ops_per_replay``, in µs,
    largest first."""
    from torch.profiler import ProfilerActivity, profile

    from arfusion.engine.step_profile import kernel_totals

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    totals = kernel_totals(prof, name_chars=60)
    return {name: us / (replays * ops_per_replay) for name, (us, _) in sorted(totals.items(), key=lambda kv: -kv[1][0])}
