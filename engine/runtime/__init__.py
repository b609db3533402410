"""The model runtime of one TP rank: its parts and their build order, the runner, CUDA graphs,
step plans, sampling."""
