"""The host side of the one-shot Lamport backend (fusion/backends/lamport_one_shot.py) without a
GPU: the buffer layout, the sentinel, the reasons it refuses a set-up (voted over a 2-rank gloo
group on CPU), ``fits`` bounds and ``raise_if_failed`` on a stand-in control area. The kernel
itself needs a GPU (it reads %globaltimer through inline PTX, which Triton's interpreter cannot
run): tests/gpu/test_lamport_one_shot.py.
"""
import pytest
import torch

from arfusion.fusion.backends.lamport_one_shot import (CONTROL_INTS, ERROR, INDEX, MAX_TOKENS, NUM_BUFFERS, ROWS,
                                              LamportLayout, LamportOneShotBackend, lamport_unavailable_reason,
                                              output_tensors, sentinel_bits)
from arfusion.fusion.errors import FusionInputError, FusionTimeoutError
from arfusion.fusion.group import TensorParallelGroup
from arfusion.fusion.strategy import Strategy
from tests.dist_utils import run_distributed

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("world,max_tokens,hidden,size", [(2, 512, 4096, 2), (8, 1, 896, 2), (3, 7, 64, 4)])
def test_slots_tile_the_data_region_in_buffer_sender_row_order(world, max_tokens, hidden, size):
    layout = LamportLayout(world, max_tokens, hidden, size)
    starts = [layout.slot_offset(k, p) for k in range(NUM_BUFFERS) for p in range(world)]
    assert starts == [i * max_tokens * hidden for i in range(NUM_BUFFERS * world)]
    assert layout.slot_offset(1, world - 1, max_tokens - 1) + hidden == layout.slot_offset(2, 0)
    assert layout.data_elements == NUM_BUFFERS * world * max_tokens * hidden


@pytest.mark.parametrize("max_tokens,hidden,size", [(512, 4096, 2), (3, 8, 2), (5, 4, 4), (1, 896, 2)])
def test_control_area_follows_the_data_on_a_16_byte_boundary_inside_the_buffer(max_tokens, hidden, size):
    layout = LamportLayout(2, max_tokens, hidden, size)
    data_bytes = layout.data_elements * size
    assert layout.control_offset * 4 == data_bytes and data_bytes % 16 == 0  # 16-byte rows
    assert layout.elements * size >= (layout.control_offset + CONTROL_INTS) * 4
    assert (layout.elements - 1) * size < (layout.control_offset + CONTROL_INTS) * 4  # no spare element
    assert INDEX < ERROR < ROWS and ROWS + NUM_BUFFERS <= CONTROL_INTS


@pytest.mark.parametrize("dtype,bits", [(torch.float16, torch.int16), (torch.bfloat16, torch.int16),
                                        (torch.float32, torch.int32)])
def test_the_sentinel_is_negative_zero_and_sanitised_data_never_equals_it(dtype, bits):
    width = 8 * dtype.itemsize
    assert int(torch.tensor([-0.0], dtype=dtype).view(bits).item()) % (1 << width) == sentinel_bits(dtype)
    assert int(torch.tensor([0.0], dtype=dtype).view(bits).item()) == 0  # what -0.0 is pushed as


def test_integer_dtypes_have_no_sentinel():
    with pytest.raises(FusionInputError, match="fp16, bf16 or fp32"):
        sentinel_bits(torch.int32)


@pytest.mark.parametrize("max_tokens,hidden,dtype,device,needle", [
    (MAX_TOKENS + 1, 4096, torch.bfloat16, CUDA, "outside 1..512"),
    (0, 4096, torch.bfloat16, CUDA, "outside 1..512"),
    (16, 4100, torch.bfloat16, CUDA, "not a multiple of 16 bytes"),
    (16, 4096, torch.int8, CUDA, "fp16, bf16 or fp32"),
    (16, 4096, torch.bfloat16, CPU, "needs a CUDA device"),
])
def test_a_set_up_the_kernel_cannot_run_is_refused_by_name(max_tokens, hidden, dtype, device, needle):
    assert needle in lamport_unavailable_reason(device, 2, max_tokens, hidden, dtype)


def test_on_cuda_the_reason_is_triton_or_the_hidden_size_beyond_one_row_per_program():
    reason = lamport_unavailable_reason(CUDA, 2, 16, 1 << 20, torch.bfloat16)
    assert "needs triton" in reason or "exceeds" in reason, reason


def test_in_place_outputs():
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    out, residual_out = output_tensors(x, residual)
    assert out is x and residual_out is residual
    out, residual_out = output_tensors(x, None)
    assert residual_out is x and out is not x and out.shape == x.shape


def _ready_backend(max_tokens: int) -> LamportOneShotBackend:
    """A one-rank backend whose buffer and control area are CPU stand-ins (no kernel runs)."""
    backend = LamportOneShotBackend(TensorParallelGroup(0, 1, CPU), timeout_ns=200_000_000)
    layout = LamportLayout(1, max_tokens, 64, 2)
    backend.symmetric.buffer = torch.zeros(layout.elements, dtype=torch.bfloat16)
    backend.layout = layout
    backend._control = torch.zeros(CONTROL_INTS, dtype=torch.int32)
    backend._host_error = torch.zeros(1, dtype=torch.int32)  # the kernel's host-readable copy of the flag
    return backend


def test_fits_from_one_token_to_the_ensured_max_tokens():
    backend = _ready_backend(32)
    assert [backend.fits(n) for n in (0, 1, 31, 32, 33)] == [False, True, True, True, False]
    assert backend.capacity == 32 and backend.strategy == Strategy.LAMPORT_ONE_SHOT
    backend.destroy()
    assert not backend.fits(1) and backend.capacity == 0
    backend.destroy()  # idempotent


def test_an_expired_wait_raises_naming_rank_peer_and_bound_and_turns_the_backend_off():
    backend = _ready_backend(8)
    backend.raise_if_failed()  # flag down: nothing
    backend._host_error[0] = 1 + 1  # the kernel's code: 1 + the stalled peer's rank
    with pytest.raises(FusionTimeoutError) as info:
        backend.raise_if_failed()
    message = str(info.value)
    assert "lamport_one_shot" in message and "rank 0" in message and "rank 1's rows" in message
    assert "200 ms" in message and "timeout_ns=200000000" in message
    assert not backend.fits(1)
    backend._host_error[0] = 0
    with pytest.raises(FusionTimeoutError):  # still off: the buffers are out of step
        backend.raise_if_failed()
    with pytest.raises(FusionInputError, match="off after a timeout"):
        backend.run(torch.randn(1, 64, dtype=torch.bfloat16), None, torch.ones(64, dtype=torch.bfloat16), 1e-6)


def test_a_backend_never_ensured_checks_nothing_and_refuses_a_call():
    backend = LamportOneShotBackend(TensorParallelGroup(0, 1, CPU))
    backend.raise_if_failed()
    assert not backend.fits(1)
    with pytest.raises(FusionInputError, match="capacity 0"):
        backend.run(torch.randn(1, 64), None, torch.ones(64), 1e-6)


def test_the_kernel_reads_the_control_area_where_the_backend_lays_it_out():
    kernels = pytest.importorskip("arfusion.fusion.backends.kernels.lamport_one_shot")  # needs triton
    assert kernels.CONTROL == {"index": INDEX, "arrivals": 1, "error": ERROR, "rows": ROWS}


def _ensure_on_cpu(rank, world_size, max_tokens):
    from arfusion.layers.parallel_state import get_tp_group

    backend = LamportOneShotBackend(get_tp_group())
    ok = backend.ensure(max_tokens, 64, torch.bfloat16)
    return ok, backend.fits(1), backend.failure, backend.capacity


@pytest.mark.parametrize("max_tokens,needle", [(16, "needs a CUDA device"), (MAX_TOKENS + 1, "outside 1..512")])
def test_ensure_is_refused_on_every_rank_with_each_ranks_reason(max_tokens, needle):
    for ok, fits, failure, capacity in run_distributed(_ensure_on_cpu, args=(max_tokens,)):
        assert not ok and not fits and capacity == 0
        assert "rank 0" in failure and "rank 1" in failure and needle in failure, failure
