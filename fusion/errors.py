"""Errors raised by the fusion module. Each names the problem in its message."""


class FusionInputError(ValueError):
    """An input the fused op cannot take: wrong dtype, shape, layout, hidden size or token count."""


class FusionUnsupportedError(RuntimeError):
    """A fused pattern this GPU or installation cannot run (for example FP4 below sm100)."""
