"""Comparison tolerances, per dtype, in one place."""
import torch

Tolerances = dict[torch.dtype, tuple[float, float]]

# (rtol, atol) for a fast path against the fp32-accumulated reference of the same dtype.
TOLERANCES: Tolerances = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}
# (rtol, atol) for a fast path that rounds to a half-precision dtype exactly where its reference
# rounds, both accumulating in fp32 but in different orders (a kernel's K tiles against the CPU
# GEMM's blocking, which differs by torch version and CPU): the fp32 sums differ by far less than
# a half-precision ulp, so each rounded intermediate is the reference's or one ulp from it, and
# the outputs (of magnitude about 1 here) lie within two ulps at their scale. Bit equality is not
# guaranteed: its share differs by machine.
SAME_ROUNDINGS: Tolerances = {torch.float16: (2 * torch.finfo(torch.float16).eps, torch.finfo(torch.float16).eps)}

def assert_close(actual: torch.Tensor, expected: torch.Tensor, tolerances: Tolerances = TOLERANCES) -> None:
    rtol, atol = tolerances[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
