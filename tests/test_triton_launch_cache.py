"""The launch cache of layers/kernels/triton_launch_cache.py on CPU: its key separates every
specialization Triton compiles apart (tensor dtype and 16-byte alignment, ints 1 / multiples of
16 / other and their width, constexpr values and types, options, launch_pdl, device) and equals
for equal ones; a launcher binds once per key (passing launch_pdl on when set) and then launches
the kept kernel on the driver's current stream; the cache is bounded; under Triton's interpreter it is off and the batch-invariant matmul
still matches torch. The direct launch of a real compiled kernel is tested on the GPU
(tests/gpu/test_triton_launch_cache.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_under_triton_interpreter

pytest.importorskip("triton")

from arfusion.layers.kernels.triton_launch_cache import CachedLauncher, arg_tag, launch_key  # noqa: E402

CONSTEXPR = (False, False, False, True)


def _key(x, n, flag, block, warps=4, stages=3, device=0, debug=False, pdl=False):
    return launch_key((x, n, flag, block), CONSTEXPR, warps, stages, device, debug, pdl)


def test_tensor_tag_is_dtype_and_16_byte_alignment():
    base = torch.zeros(64, dtype=torch.bfloat16)
    assert base.data_ptr() % 16 == 0
    assert arg_tag(base) == arg_tag(base[8:]) == (torch.bfloat16, True)  # 16 bytes in
    assert arg_tag(base[1:]) == arg_tag(base[4:]) == (torch.bfloat16, False)  # 2 and 8 bytes in
    assert arg_tag(base.float()) != arg_tag(base)
    assert arg_tag(torch.nn.Parameter(base)) == arg_tag(base)


def test_int_tag_follows_triton_one_divisibility_and_width():
    tags = {v: arg_tag(v) for v in (1, 16, 17, 32, 0, -16, 33, 2 ** 31 - 16, 2 ** 31, -2 ** 31 - 16, 2 ** 63)}
    assert tags[16] == tags[32] == tags[0] == tags[-16] == tags[2 ** 31 - 16]  # i32, divisible by 16
    assert tags[17] == tags[33]  # i32, not divisible
    assert len({tags[1], tags[16], tags[17]}) == 3
    assert len({tags[16], tags[2 ** 31], tags[2 ** 63]}) == 3  # i32, i64, u64
    assert tags[2 ** 31] == tags[-2 ** 31 - 16]
    assert arg_tag(True) == arg_tag(False) != arg_tag(1)
    assert arg_tag(None) is type(None) and arg_tag(0.5) is float
    assert arg_tag((1, 2)) is None and arg_tag("s") is None


def test_launch_key_separates_specializations_and_equates_equal_ones():
    base = torch.zeros(256, dtype=torch.float16)
    same = torch.ones(256, dtype=torch.float16)
    assert _key(base, 64, True, 32) == _key(same, 48, True, 32) == _key(base[16:], 16, True, 32)
    variants = [_key(base, 64, True, 32), _key(base[1:], 64, True, 32), _key(base.float(), 64, True, 32),
                _key(base, 1, True, 32), _key(base, 17, True, 32), _key(base, 2 ** 31, True, 32),
                _key(base, 64, 1.0, 32), _key(base, 64, None, 32), _key(base, 64, True, 64),
                _key(base, 64, True, True), _key(base, 64, True, 32, warps=8),
                _key(base, 64, True, 32, stages=None), _key(base, 64, True, 32, device=1),
                _key(base, 64, True, 32, debug=True), _key(base, 64, True, 32, pdl=True)]
    assert len(set(variants)) == len(variants)
    assert _key(base, 64, True, (1, 2)) is None  # a constexpr of a type not keyed
    assert _key(base, (1, 2), True, 32) is None
    assert launch_key((base, 64), CONSTEXPR, 4, 3, 0, False) is None  # argument count


class _FakeCompiled:
    """Stands for a CompiledKernel: records launches as (grid, args, stream)."""

    module = None  # nothing loaded (CompiledKernel.__del__ reads it)

    def __init__(self, launches):
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args, stream=None: self.launches.append((grid, args, stream))


class _FakeKernel:
    """A jit kernel with parameters (x, n, flag, BLOCK: constexpr); a bound launch is recorded
    as ("bind", grid, args, options) and returns ``make()``."""

    def __init__(self, make):
        self.params = [SimpleNamespace(is_constexpr=c) for c in CONSTEXPR]
        self.binds, self.launches, self.make = [], [], make

    def __getitem__(self, grid):
        def bind(*args, **options):
            self.binds.append((grid, args, options))
            return self.make(self.launches)
        return bind


def _fake_launcher(monkeypatch, max_entries: int = 64):
    import triton.compiler

    compiled_type = type("CompiledStandIn", (_FakeCompiled, triton.compiler.CompiledKernel), {})
    kernel = _FakeKernel(compiled_type)
    launcher = CachedLauncher(kernel, max_entries=max_entries)
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 1234 + device)
    monkeypatch.setattr(launcher, "_driver", SimpleNamespace(active=active))
    return kernel, launcher


def test_launcher_binds_once_per_specialization_then_launches_directly(monkeypatch):
    kernel, launcher = _fake_launcher(monkeypatch)
    x = torch.zeros(64, dtype=torch.float16)
    launcher((3,), x, 64, True, 32, num_warps=4)
    launcher((5, 2), x, 48, True, 32, num_warps=4)
    assert kernel.binds == [((3,), (x, 64, True, 32), {"num_warps": 4})]
    assert kernel.launches == [((5, 2, 1), (x, 48, True, 32), 1234)] and launcher.hits == 1
    launcher((3,), x[1:], 48, True, 32, num_warps=4)  # misaligned: binds again
    launcher((3,), x, 48, True, 64, num_warps=4, num_stages=2)  # another constexpr and option
    assert len(kernel.binds) == 3 and len(launcher) == 3 and launcher.hits == 1
    launcher.enabled = False
    launcher((3,), x, 64, True, 32, num_warps=4)
    assert len(kernel.binds) == 4 and launcher.hits == 1


def test_launcher_keys_and_passes_programmatic_dependent_launch(monkeypatch):
    kernel, launcher = _fake_launcher(monkeypatch)
    x = torch.zeros(64, dtype=torch.float16)
    launcher((3,), x, 64, True, 32, num_warps=4)
    launcher((3,), x, 64, True, 32, num_warps=4, launch_pdl=True)  # another kernel: binds again
    launcher((3,), x, 48, True, 32, num_warps=4, launch_pdl=True)
    assert [options for _, _, options in kernel.binds] == [{"num_warps": 4}, {"num_warps": 4, "launch_pdl": True}]
    assert launcher.hits == 1 and len(launcher) == 2


def test_launcher_keeps_at_most_max_entries_least_recent_out(monkeypatch):
    kernel, launcher = _fake_launcher(monkeypatch, max_entries=2)
    x = torch.zeros(64, dtype=torch.float16)
    for block in (16, 32, 16, 64, 16, 32):  # 32 was least recent when 64 came
        launcher((1,), x, 64, True, block)
    assert len(launcher) == 2
    assert [args[3] for _, args, _ in kernel.binds] == [16, 32, 64, 32]
    assert launcher.hits == 2


def test_launcher_turns_off_when_the_launch_returns_no_compiled_kernel():
    kernel = _FakeKernel(lambda launches: None)
    launcher = CachedLauncher(kernel)
    launcher._driver = SimpleNamespace(active=SimpleNamespace(get_current_device=lambda: 0))
    x = torch.zeros(64, dtype=torch.float16)
    for _ in range(3):
        launcher((1,), x, 64, True, 32)
    assert len(kernel.binds) == 3 and len(launcher) == 0 and launcher.hits == 0


def _interpreted(rank: int, world_size: int) -> dict:
    """In the TRITON_INTERPRET=1 child: the matmul's launchers' state after a few calls, and the
    max error against torch."""
    from arfusion.layers.kernels import triton_bi_matmul as bm

    gen = torch.Generator().manual_seed(5)
    w, b, x = torch.randn(48, 80, generator=gen), torch.randn(48, generator=gen), torch.randn(9, 80, generator=gen)
    cfg = bm.MatmulConfig(16, 16, 32, 2, 4, 1)
    outs = [bm.matmul(x, w, b, cfg), bm.matmul(x, w, b, cfg), bm.matmul(x[1:], w, None, cfg)]
    errors = [(outs[0] - F.linear(x, w, b)).abs().max().item(), (outs[2] - F.linear(x[1:], w)).abs().max().item()]
    launcher = bm.MATMUL_LAUNCHER
    return {"error": max(errors), "same": torch.equal(outs[0], outs[1]), "cached": len(launcher),
            "hits": launcher.hits}


@pytest.mark.timeout(300)
def test_under_the_interpreter_the_cache_is_off_and_matmul_matches_torch():
    result = run_under_triton_interpreter(_interpreted)
    assert result["error"] < 1e-4 and result["same"]
    assert result["cached"] == 0 and result["hits"] == 0
