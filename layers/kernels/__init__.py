"""Triton kernels of the TP building blocks (each with a torch reference in the layer that calls it)."""
