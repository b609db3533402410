"""Measuring the strategies: CUDA-graph timing, the table measurement, and tuning at start-up."""
