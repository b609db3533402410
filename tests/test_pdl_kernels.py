"""Programmatic dependent launch (layers/kernels/pdl.py) in the Triton kernels of a decode step,
without a GPU.

Compiled for sm90 (tests/offline_triton.py: the launches each public function makes are recorded,
with the switch off and on, then compiled with the specialisation a GPU launch would get; skipped
where triton's NVIDIA backend cannot compile), at Qwen3-30B-A3B's decode shapes (gpt-oss-20b's
for the MXFP4 experts), one token, the routing with and without the post-attention norm inside:
- every launch passes ``USE_PDL`` and the launch option ``launch_pdl`` equal to the switch;
- with the switch on the PTX holds ``griddepcontrol.wait`` and ``griddepcontrol.launch_dependents``
  (in that order), with it off neither: the switch is not a path that does nothing;
- before the wait no global store or atomic, and global loads only in the kernels that load data
  no kernel of a step writes there (the skinny matmul's bulk L2 prefetch of its first columns,
  and nothing into registers; the routing's first weight tile; rotary's inverse frequencies, in
  the rotary launch and in the decode attention that rotates) or that a kernel before their
  predecessor wrote (the matrix-vector experts' per-slot down launches, bf16 and MXFP4: the
  routing's ids and the first K step of the experts' weights they select):
  the others (decode attention's split kernel, with or without the combine inside, and its
  combine kernel, the experts' gate/up launches, whose weights
  depend on the routing just before them, and the bf16 per-token down launch) load nothing
  before it;
- every dot takes the same tensor-core instruction (family and k) either way, and the decode
  attention that rotates takes the split kernel's.

Under Triton's interpreter (one spawned child), which runs programs one at a time and has no
griddepcontrol instructions (it raises on them), the two calls are stood in by functions that do
nothing: each public function's outputs with the switch on equal those with it off bit for bit,
so the code only USE_PDL compiles (the routing's first weight tile) computes what the loop
computes (the skinny matmul's prefetch, inline PTX, is left out there). Inputs fp32 / fp16 (the
interpreter's bf16 dots multiply bit patterns), seeded random, with several K steps and masked
tails.
"""
from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch

from tests.dist_utils import run_under_triton_interpreter

pytest.importorskip("triton")

from arfusion.layers.kernels import pdl  # noqa: E402

# kernels that load data before the wait (weights, inv_freq); the others load nothing there
LOADS_BEFORE_WAIT = {"_skinny_kernel", "_route_kernel", "_route_kernel norm", "_rotary_kernel", "_rotary_split_kernel",
                     "_topk_combine_norm_kernel", "_down_rows_gemv_kernel", "_gemv_kernel down"}
# every launch of one decode step's kernels (the MXFP4 experts' kernel twice: gate/up, then down;
# decode attention's split kernel with its combine inside, and with the combine launch after it)
LAUNCHES = ("_skinny_kernel", "_norm_matmul_kernel", "_rotary_kernel", "_split_kernel", "_split_kernel partials",
            "_combine_kernel", "_rotary_split_kernel", "_route_kernel",
            "_route_kernel norm", "_gate_up_silu_gemv_kernel", "_down_combine_gemv_kernel", "_gate_up_silu_gemv_kernel",
            "_down_rows_gemv_kernel", "_gemv_kernel gate/up", "_gemv_kernel down",
            "_topk_combine_kernel", "_topk_combine_norm_kernel")
BF16 = torch.bfloat16


class RecordedLauncher:
    """Stands in for a `CachedLauncher`: ``launcher(grid, *args, **options)`` records the call."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.calls: list[tuple[tuple, dict]] = []

    def __call__(self, grid: Any, *args: Any, **options: Any) -> None:
        self.calls.append((args, options))


def _decode_step_calls() -> None:
    """One token through each public function at Qwen3-30B-A3B's shapes (gpt-oss-20b's for the
    MXFP4 experts), CPU tensors (nothing runs: the kernels are recorders)."""
    from arfusion.layers.head_norm import HeadNorm
    from arfusion.layers.kernels.triton_decode_attention import decode_attention
    from arfusion.layers.kernels.triton_norm_matmul import norm_linear
    from arfusion.layers.kernels.triton_rotary import rotary_embedding_store_kv
    from arfusion.layers.kernels.triton_rotary_decode_attention import decode_attention_rotary
    from arfusion.layers.kernels.triton_skinny_matmul import skinny_linear
    from arfusion.layers.moe.kernels.mxfp4_moe_config import GEMV_CONFIG
    from arfusion.layers.moe.kernels.triton_moe_gemv import moe_gemv
    from arfusion.layers.moe.kernels.triton_mxfp4_gemv import gemv_partials
    from arfusion.layers.moe.kernels.triton_route_norm import RouteNorm
    from arfusion.layers.moe.kernels.triton_router import route_triton
    from arfusion.layers.moe.kernels.triton_topk_combine import combine, combine_add_rms_norm

    g = torch.Generator().manual_seed(0)
    skinny_linear(torch.randn(1, 4096, generator=g).to(BF16), torch.empty(2048, 4096, dtype=BF16))
    x, residual = torch.randn(2, 1, 2048, generator=g).to(BF16)
    norm_linear(x, residual, torch.ones(2048, dtype=BF16), 1e-6, torch.empty(5120, 2048, dtype=BF16))
    qkv = torch.randn(1, (32 + 8) * 128, generator=g).to(BF16)
    q, k, v = qkv.split([32 * 128, 4 * 128, 4 * 128], dim=1)
    cache = torch.empty(4096, 4, 128, dtype=BF16)
    rotary_embedding_store_kv(torch.tensor([100]), q, k, v, torch.rand(64), torch.tensor([7]), cache, cache.clone(),
                              head_norm=HeadNorm(torch.ones(128, dtype=BF16), torch.ones(128, dtype=BF16), 1e-6))
    for combine_in_split in (True, False):
        decode_attention(torch.randn(1, 32, 128, generator=g).to(BF16), cache, cache,
                         torch.zeros(1, 4096, dtype=torch.int64), torch.tensor([2000]), 128 ** -0.5,
                         combine_in_split=combine_in_split)
    decode_attention_rotary(torch.tensor([100]), q, k, v, torch.rand(64), torch.tensor([7]), cache, cache.clone(),
                            torch.zeros(1, 4096, dtype=torch.int64), torch.tensor([101]), 128 ** -0.5,
                            head_norm=HeadNorm(torch.ones(128, dtype=BF16), torch.ones(128, dtype=BF16), 1e-6))
    ids = torch.randperm(128, generator=g)[:8].to(torch.int32)[None]
    route_triton(torch.randn(1, 2048, generator=g).to(BF16), torch.empty(128, 2048, dtype=BF16), 8, True,
                 torch.zeros(1, dtype=torch.int32))
    o_out, residual = torch.randn(2, 1, 2048, generator=g).to(BF16)
    route_triton(o_out, torch.empty(128, 2048, dtype=BF16), 8, True, torch.zeros(1, dtype=torch.int32),
                 norm=RouteNorm(residual, torch.ones(2048, dtype=BF16), 1e-6, torch.empty_like(o_out),
                                torch.empty_like(o_out)))
    for unformed in (False, True):  # the combine in launch 2, or left to the norm after the experts at TP1
        moe_gemv(torch.randn(1, 2048, generator=g).to(BF16), torch.empty(128, 2 * 768, 2048, dtype=BF16),
                 torch.empty(128, 2048, 768, dtype=BF16), torch.rand(1, 8, generator=g), ids, unformed=unformed)
    hidden = local = 2880
    experts = SimpleNamespace(  # a GptOssExperts' operands (MXFP4 kept), 4 of gpt-oss-20b's 32 experts
        hidden_size=hidden, local=local, alpha=1.702, limit=7.0, mxfp4=True, tp_rank=0,
        w13_blocks=torch.empty(4, 2 * local, hidden // 32, 16, dtype=torch.uint8),
        w13_scales=torch.empty(4, 2 * local, hidden // 32, dtype=torch.uint8),
        w2_blocks=torch.empty(4, hidden, local // 32, 16, dtype=torch.uint8),
        w2_scales=torch.empty(4, hidden, local // 32, dtype=torch.uint8),
        w13_bias=torch.empty(4, 2 * local, dtype=BF16), w2_bias=torch.empty(4, hidden, dtype=BF16))
    gemv_partials(torch.randn(1, hidden, generator=g).to(BF16), experts, torch.arange(4, dtype=torch.int32)[None],
                  GEMV_CONFIG)
    partial, weights = torch.randn(1, 4, hidden, generator=g), torch.rand(1, 4, generator=g)
    combine(partial, weights, BF16)  # launch 3 of the MXFP4 experts, or inside the norm after them at TP1
    combine_add_rms_norm(partial, weights, torch.randn(1, hidden, generator=g).to(BF16), torch.ones(hidden, dtype=BF16),
                         1e-5)


def _label(fn: Any, kwargs: dict) -> str:
    """The kernel's name; the MXFP4 experts' kernel's with its launch (gate/up or down); the
    routing's with the post-attention norm inside (``norm``); decode attention's split kernel
    that leaves its partials to the combine launch (``partials``)."""
    if fn.__name__ == "_gemv_kernel":
        return f"{fn.__name__} {'gate/up' if kwargs['GATE_UP'] else 'down'}"
    if fn.__name__ == "_route_kernel" and kwargs["NORM"]:
        return f"{fn.__name__} norm"
    if fn.__name__ == "_split_kernel" and not kwargs["COMBINE_IN_SPLIT"]:
        return f"{fn.__name__} partials"
    return fn.__name__


@pytest.fixture(scope="module")
def launches() -> dict[bool, list[tuple[Any, tuple, dict]]]:
    """``{switch: [(kernel, args, options)]}``: every launch of `_decode_step_calls`."""
    offline = pytest.importorskip("tests.offline_triton")
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("triton's NVIDIA backend is not installed")
    from arfusion.layers.kernels import (triton_decode_attention, triton_norm_matmul, triton_rotary,
                                         triton_rotary_decode_attention, triton_skinny_matmul)
    from arfusion.layers.moe.kernels import triton_moe_gemv, triton_mxfp4_gemv, triton_router, triton_topk_combine

    owners = {"_rotary_kernel": triton_rotary, "_split_kernel": triton_decode_attention,
              "_combine_kernel": triton_decode_attention, "_rotary_split_kernel": triton_rotary_decode_attention,
              "_route_kernel": triton_router,
              "_gate_up_silu_gemv_kernel": triton_moe_gemv, "_down_combine_gemv_kernel": triton_moe_gemv,
              "_down_rows_gemv_kernel": triton_moe_gemv,
              "_gemv_kernel": triton_mxfp4_gemv, "_topk_combine_kernel": triton_topk_combine,
              "_topk_combine_norm_kernel": triton_topk_combine}
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_router.triton.knobs.runtime, "interpret", False)
        for on in (False, True):
            recorders = [offline.RecordedKernel(getattr(module, name)) for name, module in owners.items()]
            for recorder, module in zip(recorders, owners.values()):
                patch.setattr(module, recorder.fn.__name__, recorder)
            launcher = RecordedLauncher(triton_skinny_matmul._skinny_kernel)
            patch.setattr(triton_skinny_matmul, "SKINNY_LAUNCHER", launcher)
            norm_launcher = RecordedLauncher(triton_norm_matmul._norm_matmul_kernel)
            patch.setattr(triton_norm_matmul, "NORM_MATMUL_LAUNCHER", norm_launcher)
            with pdl.pdl_mode(on):
                _decode_step_calls()
            out[on] = [(r.fn, args, kwargs) for r in (launcher, norm_launcher, *recorders) for args, kwargs in r.calls]
            for recorder, module in zip(recorders, owners.values()):
                patch.setattr(module, recorder.fn.__name__, recorder.fn)
    return out


@pytest.fixture(scope="module")
def compiled(launches) -> dict[tuple[str, bool], dict[str, str]]:
    """``{(launch, switch): {"ptx", "ttgir"}}`` of each launch (`_label`) compiled for sm90."""
    from tests.offline_triton import compiled_asm

    out = {}
    for on, calls in launches.items():
        for fn, args, kwargs in calls:
            asm = compiled_asm(fn, args, kwargs)
            out[_label(fn, kwargs), on] = {"ptx": asm["ptx"], "ttgir": asm["ttgir"]}
    return out


def _use_pdl(fn: Any, args: tuple, kwargs: dict) -> Any:
    return kwargs["USE_PDL"] if "USE_PDL" in kwargs else args[fn.arg_names.index("USE_PDL")]


def test_every_kernel_of_the_step_launches_with_the_switch(launches):
    for on, calls in launches.items():
        assert sorted(_label(fn, kwargs) for fn, _, kwargs in calls) == sorted(LAUNCHES)
        for fn, args, kwargs in calls:
            assert _use_pdl(fn, args, kwargs) is on and kwargs.get("launch_pdl", False) is on, (fn.__name__, on)


def _before_wait(ptx: str) -> str:
    return ptx[:ptx.index("griddepcontrol.wait")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", LAUNCHES)
def test_sm90_ptx_waits_only_with_the_switch_on(compiled, name):
    off, on = compiled[name, False]["ptx"], compiled[name, True]["ptx"]
    assert "griddepcontrol" not in off
    assert on.count("griddepcontrol.wait") == 1 and on.count("griddepcontrol.launch_dependents") == 1
    assert on.index("griddepcontrol.wait") < on.index("griddepcontrol.launch_dependents")
    before = _before_wait(on)
    assert not re.search(r"\b(?:st|atom|red)\.global", before), name
    loads = re.findall(r"\b(?:ld\.global|cp\.async)\S*", before)
    assert bool(loads) == (name in LOADS_BEFORE_WAIT), (name, loads)


def test_sm90_the_skinny_matmul_asks_l2_for_its_first_columns_before_the_wait(compiled):
    before = _before_wait(compiled["_skinny_kernel", True]["ptx"])
    assert "cp.async.bulk.prefetch.L2.global" in before
    assert not re.search(r"\bld\.global", before), "no register waits on a load before the wait"
    assert "cp.async.bulk.prefetch" not in compiled["_skinny_kernel", False]["ptx"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["_skinny_kernel", "_split_kernel", "_rotary_split_kernel", "_route_kernel",
                                  "_route_kernel norm"])
def test_sm90_dots_take_the_same_instruction_either_way(compiled, name):
    from tests.offline_triton import mma_versions, ptx_mma_k

    off, on = compiled[name, False], compiled[name, True]
    assert mma_versions(off["ttgir"]) and mma_versions(on["ttgir"]) == mma_versions(off["ttgir"])
    assert ptx_mma_k(on["ptx"]) == ptx_mma_k(off["ptx"]) != set()


def test_sm90_the_rotating_attention_dots_as_the_split_kernel(compiled):
    from tests.offline_triton import mma_versions, ptx_mma_k

    fused, split = compiled["_rotary_split_kernel", False], compiled["_split_kernel", False]
    assert mma_versions(fused["ttgir"]) == mma_versions(split["ttgir"])
    assert ptx_mma_k(fused["ptx"]) == ptx_mma_k(split["ptx"])


# --- under the interpreter: the same bits with the switch on ----------------------------------

def _skinny_cases(g: torch.Generator) -> dict[str, Callable[[], Any]]:
    from arfusion.layers.kernels.triton_skinny_matmul import SkinnyConfig, skinny_linear

    cases = {}
    for m, n, k, block_k, bias in ((3, 40, 80, 32, True), (5, 64, 128, 32, False), (1, 16, 32, 32, True)):
        x, w = torch.randn(m, k, generator=g).half(), torch.randn(n, k, generator=g).half()
        b = torch.randn(n, generator=g).half() if bias else None
        cases[f"skinny m{m} n{n} k{k}"] = lambda x=x, w=w, b=b, bk=block_k: skinny_linear(
            x, w, b, SkinnyConfig(16, bk, 4, 2))
    return cases


def _attention_cases(g: torch.Generator) -> dict[str, Callable[[], Any]]:
    from arfusion.layers.head_norm import HeadNorm
    from arfusion.layers.kernels.triton_decode_attention import decode_attention
    from arfusion.layers.kernels.triton_rotary import rotary_embedding_store_kv
    from arfusion.layers.kernels.triton_rotary_decode_attention import decode_attention_rotary

    tokens, heads, kv_heads, d = 3, 4, 2, 32
    q, k, v = (torch.randn(tokens, h * d, generator=g) for h in (heads, kv_heads, kv_heads))
    norm = HeadNorm(torch.randn(d, generator=g) * 0.1 + 1, torch.randn(d, generator=g) * 0.1 + 1, 1e-6)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2) / d)
    positions, slots = torch.tensor([5, 70, 33]), torch.tensor([11, 3, 40])

    def rotary() -> tuple:
        caches = torch.randn(2, 64, kv_heads, d, generator=torch.Generator().manual_seed(1))
        q_out = rotary_embedding_store_kv(positions, q, k, v, inv_freq, slots, caches[0], caches[1], head_norm=norm)
        return q_out, caches

    cache_g = torch.Generator().manual_seed(2)
    k_cache, v_cache = torch.randn(256, kv_heads, d, generator=cache_g), torch.randn(256, kv_heads, d, generator=cache_g)
    table = torch.randperm(256, generator=cache_g)[:2 * 96].reshape(2, 96)
    table3 = torch.randperm(512, generator=cache_g)[:3 * 96].reshape(3, 96)
    slots3 = table3[torch.arange(3), positions]  # each row's new key: its slot at its position
    query = torch.randn(2, heads, d, generator=g)
    def rotary_attention() -> tuple:
        caches = torch.randn(2, 512, kv_heads, d, generator=torch.Generator().manual_seed(1))
        out = decode_attention_rotary(positions, q, k, v, inv_freq, slots3, caches[0], caches[1], table3,
                                      positions + 1, d ** -0.5, head_norm=norm, num_splits=3)
        return out, caches

    return {"rotary + q/k norm + KV store": rotary,
            "decode attention with rotary, q/k norm and KV store inside, 3 splits": rotary_attention,
            "decode attention, 3 splits": lambda: decode_attention(query, k_cache, v_cache, table,
                                                                   torch.tensor([70, 33]), d ** -0.5, num_splits=3)}


def _moe_cases(g: torch.Generator) -> dict[str, Callable[[], Any]]:
    from arfusion.layers.moe.gpt_oss_moe import GptOssExperts
    from arfusion.layers.moe.kernels.triton_moe_gemv import MoEGemvConfig, moe_gemv
    from arfusion.layers.moe.kernels.triton_mxfp4_moe import Mxfp4MoEConfig, gpt_oss_experts_triton
    from arfusion.layers.moe.kernels.triton_route_norm import RouteNorm
    from arfusion.layers.moe.kernels.triton_router import route_triton
    from tests.test_gpt_oss_moe_triton import fill_experts

    tokens, hidden, inter, experts = 3, 320, 96, 8
    h, gate, bias = torch.randn(tokens, hidden, generator=g), torch.randn(experts, hidden, generator=g), torch.randn(8)
    residual, norm_weight = torch.randn(tokens, hidden, generator=g), 1 + 0.1 * torch.randn(hidden, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, 2, generator=g)
    w13, w2 = torch.randn(experts, 2 * inter, hidden, generator=g), torch.randn(experts, hidden, inter, generator=g)
    gemv = MoEGemvConfig(block_n_gate_up=8, block_k_gate_up=64, block_n_down=8, block_k_down=32)
    mxfp4 = GptOssExperts(experts, 96, 160, 1.702, 7.0, True, torch.float32, None)
    fill_experts(mxfp4, 3)
    mx_config = Mxfp4MoEConfig(block_m=1, block_n_gate_up=16, block_k_gate_up=64, block_n_down=32, block_k_down=32,
                               gemv=True)
    x96 = torch.randn(tokens, 96, generator=g)

    def routing(norm: bool = False) -> tuple:
        normed = RouteNorm(residual, norm_weight, 1e-6, torch.empty_like(h), torch.empty_like(h)) if norm else None
        w, i, blocks = route_triton(h, gate, 2, True, torch.zeros(1, dtype=torch.int32), 16, bias, normed,
                                    one_launch=True)
        return (w, i, blocks.sorted_slots, blocks.block_expert, blocks.num_rows) + (normed[3:] if norm else ())

    return {"routing (bias, grouped by expert)": routing,
            "routing with the norm inside (bias, grouped by expert)": lambda: routing(norm=True),
            "experts, matrix-vector": lambda: moe_gemv(h, w13, w2, weights, ids, gemv),
            "MXFP4 experts, matrix-vector": lambda: gpt_oss_experts_triton(x96, mxfp4, weights, ids, mx_config),
            "MXFP4 experts, matrix-vector, the combine inside the next norm": lambda: gpt_oss_experts_triton(
                x96, mxfp4, weights, ids, mx_config, unformed=True).add_rms_norm(
                    residual[:, :96], norm_weight[:96].contiguous(), 1e-6)}


def _interpreted(rank: int, world: int) -> dict[bool, dict[str, Any]]:
    """Each case's outputs with the switch off and on, the gdc calls stood in by no-ops."""
    import triton.language.extra.cuda as cuda

    cuda.gdc_wait = cuda.gdc_launch_dependents = lambda: None
    g = torch.Generator().manual_seed(0)
    cases = {**_skinny_cases(g), **_attention_cases(g), **_moe_cases(g)}
    results = {}
    for on in (False, True):
        with pdl.pdl_mode(on):
            results[on] = {name: run() for name, run in cases.items()}
    return results


@pytest.fixture(scope="module")
def interpreted():
    return run_under_triton_interpreter(_interpreted, timeout_s=600)


def _flat(value: Any) -> list[torch.Tensor]:
    return [t for v in value for t in _flat(v)] if isinstance(value, (tuple, list)) else [value]


CASE_NAMES = ["skinny m3 n40 k80", "skinny m5 n64 k128", "skinny m1 n16 k32", "rotary + q/k norm + KV store",
              "decode attention, 3 splits", "decode attention with rotary, q/k norm and KV store inside, 3 splits",
              "routing (bias, grouped by expert)",
              "routing with the norm inside (bias, grouped by expert)", "experts, matrix-vector",
              "MXFP4 experts, matrix-vector", "MXFP4 experts, matrix-vector, the combine inside the next norm"]


@pytest.mark.timeout(700)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_the_switch_changes_no_bit_under_the_interpreter(interpreted, case):
    assert set(interpreted[False]) == set(CASE_NAMES)
    off, on = _flat(interpreted[False][case]), _flat(interpreted[True][case])
    assert len(off) == len(on)
    for a, b in zip(off, on):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                                                  b.view(torch.uint8) if b.is_floating_point() else b), case
