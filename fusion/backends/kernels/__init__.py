"""Our own Triton kernels over torch symmetric memory."""
