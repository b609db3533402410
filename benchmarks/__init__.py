"""Benchmarks of arfusion: kernels, one batch, serving, accuracy."""
