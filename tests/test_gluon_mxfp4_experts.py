"""gpt-oss's MXFP4 experts on tensor cores (layers/moe/kernels/gluon_mxfp4_experts.py,
`Mxfp4MoEConfig.tensor_cores`) without a GPU:

- the decoder's PTX (the module's ``DECODE`` text, run instruction by instruction by a numpy model
  of its five instructions) turns random 32-bit words of eight e2m1 codes, with every scale byte
  from 1 to 128, into bf16 pairs of nibbles q and q + 4 equal to code * 2^(scale - 127) bit for
  bit (signs, zeros and the e2m1 subnormal 0.5 included); the kernel's integer factor
  ``((scale + 126) << 7) * 0x10001`` is bf16 2^(scale - 1) twice;
- compiled for sm90 (tests/offline_triton.py) at gpt-oss-20b's expert shapes at TP1, TP2 and
  TP4, with K steps of 128 and with blocks of 32 and 64 rows, both launches take mma.sync m16n8k16 with bf16 operands and ``mul.rn.bf16x2``, and touch
  no shared or local memory: the decoded weights go from the loads to the MMA in registers;
- `Mxfp4MoEConfig` refuses what the launches cannot take, and `tensor_core_refusal` names
  bf16-form weights, other activations than bf16, a K that is not a multiple of 32 and a scale
  above 2^1, reading the scales once;
- the code holds the K loop's step once and, for the rest of K after the last whole step, one
  step of each of its powers of two (the count of mma.sync in the PTX).

The GPU results: tests/gpu/test_gluon_mxfp4_experts_gpu.py.
"""
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from arfusion.layers.moe.kernels.mxfp4_moe_config import Mxfp4MoEConfig, check_config

pytest.importorskip("triton")
experts_module = pytest.importorskip("arfusion.layers.moe.kernels.gluon_mxfp4_experts")
if experts_module.gluon is None:
    pytest.skip("this triton has no Gluon", allow_module_level=True)

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
TILES = dict(block_m=8, block_n_gate_up=64, block_k_gate_up=64, block_n_down=64, block_k_down=64, num_warps=4,
             tensor_cores=True)


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """uint32 bf16 bit patterns of float64 ``values`` (round to nearest even)."""
    return torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint32) & 0xFFFF


def _bf16_value(bits: np.ndarray) -> np.ndarray:
    return ((bits.astype(np.uint32) & 0xFFFF) << 16).view(np.float32).astype(np.float64)


def _run_decode_ptx(words: np.ndarray, factor: np.ndarray) -> list[np.ndarray]:
    """The outputs ``$0..$3`` of the module's DECODE asm for inputs ``$4`` = words, ``$5`` = factor."""
    regs = {"$4": words.astype(np.uint32), "$5": factor.astype(np.uint32)}
    text = str(experts_module.DECODE.value)
    for op, dest, a, b in re.findall(r"(shl\.b32|shr\.b32|and\.b32|or\.b32|mul\.rn\.bf16x2)\s+(\S+),\s*(\S+),\s*([^;]+);",
                                     text):
        x = regs[a]
        y = regs[b] if b in regs else np.uint32(int(b, 0))
        if op == "shl.b32":
            out = (x.astype(np.uint64) << int(b)).astype(np.uint32)
        elif op == "shr.b32":
            out = x >> np.uint32(int(b))
        elif op == "and.b32":
            out = x & y
        elif op == "or.b32":
            out = x | y
        else:  # two bf16 products, each rounded once
            lo = _bf16_bits(_bf16_value(x) * _bf16_value(y))
            hi = _bf16_bits(_bf16_value(x >> 16) * _bf16_value(y >> 16))
            out = lo | (hi << 16)
        regs[dest] = out
    return [regs[f"${q}"] for q in range(4)]


def test_the_decoder_ptx_gives_each_code_times_its_scale_bit_for_bit():
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)
    scales = np.tile(np.arange(1, 129, dtype=np.uint32), 32)
    kernel_factor = ((scales + 126) << 7) * 0x10001  # as _weights computes it
    assert np.array_equal(kernel_factor, _bf16_bits(2.0 ** (scales.astype(np.float64) - 1)) * 0x10001)
    pairs = _run_decode_ptx(words, kernel_factor)
    for q, pair in enumerate(pairs):
        for half, nibble in ((0, q), (1, q + 4)):
            code = (words >> np.uint32(4 * nibble)) & 0xF
            expected = np.where(code & 8, -1.0, 1.0) * E2M1[code & 7] * 2.0 ** (scales.astype(np.float64) - 127)
            got = _bf16_value(pair >> np.uint32(16 * half))
            assert np.array_equal(got, expected), (q, half)
            assert np.array_equal(np.signbit(got), (code & 8) > 0), (q, half)  # -0 stays -0


def _stand_in_experts(inter: int) -> SimpleNamespace:
    """What the launches read of a `GptOssExperts` at gpt-oss's hidden size, this rank holding
    ``inter`` features, as CPU tensors (scales within the decoder's range)."""
    e, h = 32, 2880
    return SimpleNamespace(hidden_size=h, local=inter, num_experts=e, mxfp4=True, alpha=1.702, limit=7.0, tp_rank=0,
                           w13_bias=torch.zeros(e, 2 * inter, dtype=torch.bfloat16),
                           w2_bias=torch.zeros(e, h, dtype=torch.bfloat16),
                           w13_blocks=torch.zeros(e, 2 * inter, h // 32, 16, dtype=torch.uint8),
                           w13_scales=torch.full((e, 2 * inter, h // 32), 120, dtype=torch.uint8),
                           w2_blocks=torch.zeros(e, h, inter // 32, 16, dtype=torch.uint8),
                           w2_scales=torch.full((e, h, inter // 32), 120, dtype=torch.uint8))


# gpt-oss-20b's experts at TP1, TP2 and TP4 (MXFP4 shares padded to whole groups of 32), and an
# intermediate size of 3072 for the down launch's K steps of 128; blocks of 8, 32 and 64 rows; the
# prefetching variant
SHAPES = {"tp1": (2880, dict(TILES)),
          "tp2": (1440, dict(TILES, block_n_down=32, block_k_down=32, num_warps_down=2)),
          "tp4": (736, dict(TILES, block_n_gate_up=32, block_k_down=32, num_warps=2)),
          "k128": (3072, dict(TILES, block_k_gate_up=64, block_k_down=128, block_n_down=128)),
          "m32": (2880, dict(TILES, block_m=32)), "m64": (2880, dict(TILES, block_m=64, num_warps=8, block_n_gate_up=128,
                                                                     block_n_down=128)),
          # a K step's loads issued before the step before is multiplied (`Mxfp4MoEConfig.prefetch`)
          "tp1-prefetch": (2880, dict(TILES, prefetch=True)), "m32-prefetch": (2880, dict(TILES, block_m=32, prefetch=True)),
          "tp2-prefetch": (1440, dict(TILES, block_n_down=32, block_k_down=32, num_warps_down=2, prefetch=True)),
          "k128-prefetch": (3072, dict(TILES, block_k_gate_up=64, block_k_down=128, block_n_down=128, prefetch=True)),
          # K steps of 256 and 512 (runs of four words a thread) and the rest of K after them in a
          # step of each of its powers of two (2880 % 512 = 256 + 64, 2880 % 256 = 64, 1440 % 512 =
          # 256 + 128 + 32, 736 % 512 = 128 + 64 + 32); the prefetching variant with them
          "k512": (2880, dict(TILES, block_k_gate_up=512, block_k_down=256, num_warps=2, block_n_gate_up=32,
                              block_n_down=32)),
          "k512-tp2": (1440, dict(TILES, block_k_gate_up=512, block_k_down=512)),
          "k512-tp4": (736, dict(TILES, block_k_gate_up=512, block_k_down=512, block_n_gate_up=32, num_warps=2)),
          "k256-prefetch": (2880, dict(TILES, block_k_gate_up=256, block_k_down=256, prefetch=True))}


@pytest.mark.parametrize("shape", SHAPES)
def test_sm90_both_launches_keep_the_decoded_weights_in_registers(shape, monkeypatch):
    offline = pytest.importorskip("tests.offline_triton")
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("triton's NVIDIA backend is not installed")
    from arfusion.layers.moe.align import align_by_expert

    inter, tiles = SHAPES[shape]
    cfg = Mxfp4MoEConfig(**tiles)
    check_config(cfg, True)
    recorder = offline.RecordedKernel(experts_module._experts_kernel)
    monkeypatch.setattr(experts_module, "_experts_kernel", recorder)
    experts = _stand_in_experts(inter)
    ids = torch.stack([torch.randperm(32, generator=torch.Generator().manual_seed(t))[:4] for t in range(5)]).int()
    x = torch.zeros(5, 2880, dtype=torch.bfloat16)
    assert experts_module.tensor_core_refusal(x.dtype, experts, cfg) is None
    experts_module.tensor_core_partials(x, experts, ids, align_by_expert(ids, 32, 8), cfg)
    assert [kwargs["GATE_UP"] for _, kwargs in recorder.calls] == [True, False]
    for args, kwargs in recorder.calls:
        ptx = offline.compiled_asm(recorder.fn, args, kwargs)["ptx"]
        assert set(re.findall(r"mma\.sync\.aligned\.\S+", ptx)) == {"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"}
        if not cfg.prefetch:  # the code holds the K loop's step once and one step of each power of two in K % step
            k_size, block_k, block_n = ((2880, cfg.block_k_gate_up, cfg.block_n_gate_up) if kwargs["GATE_UP"] else
                                        (inter, cfg.block_k_down, cfg.block_n_down))
            warps = cfg.num_warps if kwargs["GATE_UP"] else cfg.num_warps_down or cfg.num_warps
            columns = (block_k if k_size >= block_k else 0) + k_size % block_k
            tiles = block_n // (16 * warps) * (cfg.block_m // 8) * (2 if kwargs["GATE_UP"] else 1)
            assert ptx.count("mma.sync.aligned") == tiles * columns // 16, (kwargs["GATE_UP"], k_size, block_k)
        assert "mul.rn.bf16x2" in ptx
        assert not re.search(r"\b(?:ld|st)\.shared|\.local\b", ptx), "the weights go through memory"


@pytest.mark.parametrize("field, value, message", [
    ("block_m", 4, "blocks of 8 to 64"), ("block_m", 128, "blocks of 8 to 64"), ("swap", True, "no gemv, swap"), ("word_decode", True, "no gemv, swap"),
    ("split_k_down", 2, "no gemv, swap"), ("gemv", True, "no gemv, swap"), ("block_n_gate_up", 32, "multiple of 16 x"),
    ("block_k_down", 1024, "K steps of 32 to 512"),
])
def test_the_config_refuses_what_the_launches_cannot_take(field, value, message):
    cfg = Mxfp4MoEConfig(**dict(TILES, **{field: value}))
    with pytest.raises(ValueError, match=message):
        check_config(cfg, True)


def test_the_config_refuses_prefetch_outside_the_tensor_core_launches():
    with pytest.raises(ValueError, match="prefetch is a variant of the tensor-core launches"):
        check_config(Mxfp4MoEConfig(**dict(TILES, block_m=16, tensor_cores=False, prefetch=True)), True)


def test_the_config_refuses_bf16_form_weights():
    with pytest.raises(ValueError, match="MXFP4 weights only"):
        check_config(Mxfp4MoEConfig(**TILES), False)


def test_the_refusal_names_each_limit():
    cfg = Mxfp4MoEConfig(**TILES)
    experts = _stand_in_experts(2880)
    x = torch.zeros(2, 2880, dtype=torch.bfloat16)
    assert "bf16 activations" in experts_module.tensor_core_refusal(torch.float32, experts, cfg)
    assert "size 1448 is not a multiple of 32" in experts_module.tensor_core_refusal(x.dtype, _stand_in_experts(1448), cfg)
    assert experts_module.tensor_core_refusal(x.dtype, _stand_in_experts(1440), cfg) is None  # tail steps of 32
    big = _stand_in_experts(2880)
    big.w2_scales[3, 7, 1] = 129
    assert "2^2 exceeds" in experts_module.tensor_core_refusal(x.dtype, big, cfg)
    big.w2_scales[3, 7, 1] = 0  # read once per experts object
    assert "2^2 exceeds" in experts_module.tensor_core_refusal(x.dtype, big, cfg)
    assert experts_module.tensor_core_refusal(x.dtype, experts, cfg) is None
    assert "MXFP4 weights only" in experts_module.tensor_core_refusal(x.dtype, SimpleNamespace(mxfp4=False), cfg)
    ahead = Mxfp4MoEConfig(**dict(TILES, block_k_down=32, prefetch=True))  # one K step: nothing ahead, still taken
    assert experts_module.tensor_core_refusal(x.dtype, _stand_in_experts(32), ahead) is None

