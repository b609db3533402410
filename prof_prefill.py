import cProfile, pstats, sys, time
import torch
import arfusion.engine.bench_one_batch as b
from arfusion.engine.scheduling.static_batch import StaticBatch, random_prompts

_orig = b.measure

def measure(runner, bs, input_len, output_len, vocab, seed, overlap=True):
    r = _orig(runner, bs, input_len, output_len, vocab, seed, overlap)
    if output_len > 2:
        from arfusion.layers import batch_invariant
        times = []
        for i in range(5):
            batch = StaticBatch(runner, random_prompts(bs, input_len, vocab, seed + 10 + i), 2)
            torch.cuda.synchronize()
            t = time.perf_counter(); batch.prefill_greedy().get(); times.append((time.perf_counter() - t) * 1e3)
        print("PLAIN det=", batch_invariant.enabled(), [round(x, 1) for x in times], flush=True)
        batch = StaticBatch(runner, random_prompts(bs, input_len, vocab, seed), 2)
        torch.cuda.synchronize()
        pr = cProfile.Profile(); t = time.perf_counter(); pr.enable(); batch.prefill_greedy().get(); pr.disable()
        print("PROFILED det=", batch_invariant.enabled(), (time.perf_counter() - t) * 1e3, flush=True)
        pstats.Stats(pr).sort_stats("tottime").print_stats(22)
        pstats.Stats(pr).sort_stats("cumulative").print_stats(30)
    return r

b.measure = measure

if __name__ == "__main__":
    sys.exit(b.main(sys.argv[1:]))
