"""The backends: one object per strategy, owning the resource it runs on (a flashinfer workspace,
a symmetric buffer, nothing for NCCL and the torch reference). The contract: `base.Backend`;
which strategies exist and how an op makes them: `fusion.strategies`."""
from arfusion.fusion.backends.base import Backend

__all__ = ["Backend"]
