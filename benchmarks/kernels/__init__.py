"""Kernel-level benchmarks (torchrun scripts) and their report/plot helpers."""
