"""The model runtime of one TP rank: runner, CUDA graphs, step plans, sampling, worker loop."""
