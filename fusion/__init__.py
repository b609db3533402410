"""arfusion's fused all-reduce + residual add + RMSNorm for tensor-parallel inference."""
from arfusion.fusion.allreduce_fusion import AllReduceFusion
from arfusion.fusion.backends.flashinfer_workspace import AllReduceFusionWorkspace
from arfusion.fusion.capturable import disable_capturable_collectives, enable_capturable_collectives
from arfusion.fusion.config import FusionConfig
from arfusion.fusion.errors import FusionInputError, FusionTimeoutError, FusionUnsupportedError
from arfusion.fusion.functional import all_reduce_add_rms_norm
from arfusion.fusion.group import TensorParallelGroup
from arfusion.fusion.partial_sum import PartialSum, UnformedSum
from arfusion.fusion.strategy import FusedOutput, Quant, Strategy

__all__ = [
    "AllReduceFusion",
    "AllReduceFusionWorkspace",
    "FusedOutput",
    "FusionConfig",
    "FusionInputError",
    "FusionTimeoutError",
    "FusionUnsupportedError",
    "PartialSum",
    "Quant",
    "Strategy",
    "TensorParallelGroup",
    "UnformedSum",
    "all_reduce_add_rms_norm",
    "disable_capturable_collectives",
    "enable_capturable_collectives",
]
