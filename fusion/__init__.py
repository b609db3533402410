"""arfusion's fused all-reduce + residual add + RMSNorm for tensor-parallel inference."""
from fusion.allreduce_fusion import AllReduceFusion
from fusion.backends.flashinfer_workspace import AllReduceFusionWorkspace
from fusion.capturable import disable_capturable_collectives, enable_capturable_collectives
from fusion.config import FusionConfig
from fusion.errors import FusionInputError, FusionTimeoutError, FusionUnsupportedError
from fusion.functional import all_reduce_add_rms_norm
from fusion.group import TensorParallelGroup
from fusion.partial_sum import PartialSum
from fusion.strategy import FusedOutput, Quant, Strategy

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
    "all_reduce_add_rms_norm",
    "disable_capturable_collectives",
    "enable_capturable_collectives",
]
