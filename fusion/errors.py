"""Errors raised by the fusion module. Each names the problem in its message."""


class FusionInputError(ValueError):
    """An input the fused op cannot take: wrong dtype, shape, layout, hidden size or token count."""


class FusionUnsupportedError(RuntimeError):
    """A fused pattern this GPU or installation cannot run (for example FP4 below sm100)."""


class FusionTimeoutError(RuntimeError):
    """A fused kernel's bounded wait for a peer rank expired: the peer stalled or died. The
    kernel's outputs of that call are garbage and the backend's buffers are out of step, so the
    op refuses further calls on it."""
