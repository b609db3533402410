"""SGLang's one-batch benchmark with SGLang's plugins loaded first.

``python -m sglang.bench_one_batch`` (0.5.11-0.5.17) never calls ``load_plugins()`` (only the
server entry points do), so a plugin would stay out of it. This entry point loads them (SGLang's
own loader: arfusion's hooks when ``ARFUSION_SGLANG=1``), then runs SGLang's benchmark with the
same arguments. The benchmark forks its TP workers (Python's default start method on Linux up to
3.13), which inherit the applied hooks.

    python -m arfusion.benchmarks.integrations.sglang_one_batch --model-path M --load-format dummy --tp-size 2 ...
"""
import runpy
import sys

if __name__ == "__main__":
    from sglang.srt.plugins import load_plugins

    load_plugins()
    sys.argv[0] = "sglang.bench_one_batch"
    runpy.run_module("sglang.bench_one_batch", run_name="__main__", alter_sys=True)
