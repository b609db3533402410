"""The fusion backend options (``FusionConfig.backend``, ``--allreduce-fusion-backend``): each
offers the strategies whose backend classes name it in their ``options``
(`fusion.backends.base.Backend`). Plain names, importable without any backend.

    flashinfer   the trtllm fused kernel and the symmetric-memory strategies (sm90/sm100 GPUs)
    torch        the same math in one function on any device
"""
FLASHINFER = "flashinfer"
TORCH = "torch"
FUSION_BACKENDS: tuple[str, ...] = (FLASHINFER, TORCH)
