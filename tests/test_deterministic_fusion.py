"""Deterministic mode of the fused op on CPU: fusion stays on and a row's bits never depend on
the other rows of the call, whichever strategy the dispatch picks.

- the canonical recipe's pieces (fusion/reference.py) on one process: the fixed tree against a
  recursive fp32 tree written independently and against float64, row by row for several row
  counts; the rank-order sum against an fp32 loop; the whole recipe against its definition in
  float64 (within the dtype's rounding);
- 2 ranks over gloo, the "torch" fusion backend, bf16 and fp32, hidden 160 (a row padded to 256 in the
  tree): fixed random probe rows embedded at a different position among T - 1 other random
  rows, T = 1 ... 512 with every count around the dispatch's cut-off (the torch backend's limit,
  100 tokens, past which the dispatch picks nccl) and powers of two; the probe's normed output
  and new residual are bit-identical for every T, through the dispatch, through each strategy
  the op allows (``run``), through the unfused composition (``all_reduce`` then
  ``add_rms_norm``), and equal to the recipe computed from every rank's inputs;
- 3 ranks, fp32: the all-gather + rank-order sum path, bit-equal to the recipe;
- deterministic mode off: the same strategies give the plain reference's bits (unchanged).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from arfusion.fusion import FusionConfig, PartialSum, Strategy, reference
from arfusion.fusion.strategies import REGISTRY, deterministic_exclusions
from tests.dist_utils import make_fusion, run_distributed

EPS = 1e-6
HIDDEN = 160
LIMIT = 100  # the torch backend's token limit: the dispatch picks torch up to it, nccl beyond
TOKEN_COUNTS = sorted(set(range(1, 18)) | {31, 32, 33, 63, 64, 65, 99, 100, 101, 127, 128, 129, 255, 256, 257,
                                           383, 511, 512})
PROBES = 4  # probe rows per call (all of them when T >= 4)



def _clone_or_none(t):
    return None if t is None else t.clone()

def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a bf16/fp16/fp32 tensor (equality of these is equality of every bit, -0 included)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


# ---- the recipe's pieces, one process

def tree_sum_recursive(row: np.ndarray) -> np.float32:
    """The fixed tree written independently, one numpy float32 scalar at a time: with the row
    padded to P = 2**levels, level L's element i is level L-1's element i plus its element
    i + P / 2**L, and the sum is level ``levels``' element 0."""
    levels = max(0, len(row) - 1).bit_length()
    width = 1 << levels
    padded = [np.float32(v) for v in row] + [np.float32(0)] * (width - len(row))

    def value(level: int, i: int) -> np.float32:
        if level == 0:
            return padded[i]
        return np.float32(value(level - 1, i) + value(level - 1, i + (width >> level)))

    return value(levels, 0)


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("width", [1, 7, 96, 128, 1000])
def test_fixed_tree_sum_matches_an_independent_tree_row_by_row(rows, width):
    g = torch.Generator().manual_seed(rows * 1000 + width)
    v = torch.randn(rows, width, generator=g) * 3
    got = reference.fixed_tree_sum(v)
    assert got.shape == (rows, 1)
    for i in range(rows):
        expected = tree_sum_recursive(v[i].numpy())
        assert got[i, 0].item() == float(expected), (i, got[i, 0].item(), expected)
        alone = reference.fixed_tree_sum(v[i:i + 1])  # the same row alone: the same bits
        assert torch.equal(bits(alone[0]), bits(got[i])), i
    exact = v.double().sum(-1, keepdim=True)
    assert torch.allclose(got.double(), exact, rtol=0, atol=1e-5 * width * v.abs().max().item())


def test_fixed_tree_sum_refuses_other_dtypes():
    with pytest.raises(ValueError, match="fp32"):
        reference.fixed_tree_sum(torch.ones(2, 4, dtype=torch.float64))


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_rank_order_sum_is_an_fp32_loop_in_rank_order_rounded_once(parts):
    g = torch.Generator().manual_seed(parts)
    xs = [(torch.randn(9, 33, generator=g) * 10 ** (i % 3)).to(torch.bfloat16) for i in range(parts)]
    expected = np.zeros((9, 33), dtype=np.float32)
    for x in xs:
        expected = (expected + x.float().numpy()).astype(np.float32)
    assert torch.equal(reference.rank_order_sum(xs), torch.from_numpy(expected).to(torch.bfloat16))
    with pytest.raises(ValueError):
        reference.rank_order_sum([])


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_canonical_recipe_matches_its_definition_in_float64(dtype, with_residual):
    g = torch.Generator().manual_seed(7)
    parts = [(2 * torch.randn(5, HIDDEN, generator=g)).to(dtype) for _ in range(3)]
    residual = (2 * torch.randn(5, HIDDEN, generator=g)).to(dtype) if with_residual else None
    weight = (torch.rand(HIDDEN, generator=g) + 0.5).to(dtype)
    normed, residual_out = reference.canonical_all_reduce_add_rms_norm(parts, residual, weight, EPS)
    s = sum(p.double() for p in parts)
    res64 = s if residual is None else s.to(dtype).double() + residual.double()
    # the sum and the residual add each round once into dtype: residual_out within one ulp of float64
    ulp = torch.finfo(dtype).eps * (s.abs() + (0 if residual is None else residual.double().abs())).clamp_min(1)
    assert ((residual_out.double() - res64).abs() <= 2 * ulp).all()
    r = residual_out.double()
    normed64 = r / torch.sqrt((r * r).mean(-1, keepdim=True) + EPS) * weight.double()
    assert ((normed.double() - normed64).abs() <= 2 * torch.finfo(dtype).eps * normed64.abs().clamp_min(1)).all()


def test_canonical_zero_is_positive():
    s = torch.full((2, 8), -0.0, dtype=torch.bfloat16)
    normed, residual_out = reference.canonical_add_rms_norm(s, None, torch.ones(8, dtype=torch.bfloat16), EPS)
    assert not torch.signbit(residual_out).any() and not torch.signbit(normed).any()


def test_deterministic_mode_allows_our_strategies_and_says_why_not_flashinfer():
    for world in (2, 3, 8):
        out = deterministic_exclusions(world)
        assert Strategy.FLASHINFER_ONE_SHOT in out and Strategy.FLASHINFER_TWO_SHOT in out
        assert "rows" in out[Strategy.FLASHINFER_ONE_SHOT]
        for cls in REGISTRY:  # each class's declaration: left out beyond its det_max_world, with its note
            left_out = cls.det_max_world is not None and world > cls.det_max_world
            assert (cls.strategy in out) == left_out and out.get(cls.strategy, cls.det_note) == cls.det_note
        assert (Strategy.SYMM_MEM_TWO_SHOT not in out) == (world == 2)


# ---- 2 and 3 ranks over gloo

def rank_rows(rank: int, tokens: int, hidden: int, dtype: torch.dtype = torch.bfloat16):
    """Rank ``rank``'s partial sums of ``tokens`` random rows with the probe rows at a position
    that moves with ``tokens``; the shared residual and weight. Returns (x, residual, weight, at)."""
    g = torch.Generator().manual_seed(10_000 * tokens + rank)
    x = 2 * torch.randn(tokens, hidden, generator=g)
    shared = torch.Generator().manual_seed(10_000 * tokens + 999)
    residual = 2 * torch.randn(tokens, hidden, generator=shared)
    probe = torch.Generator().manual_seed(rank)
    probe_x = 2 * torch.randn(PROBES, hidden, generator=probe)
    probe_res = 2 * torch.randn(PROBES, hidden, generator=torch.Generator().manual_seed(999))
    n = min(PROBES, tokens)
    at = (7 * tokens) % (tokens - n + 1)  # the probes' first row: 0 at T = 1, elsewhere it moves
    x[at:at + n], residual[at:at + n] = probe_x[:n], probe_res[:n]
    weight = torch.rand(hidden, generator=torch.Generator().manual_seed(5)) + 0.5
    return x.to(dtype), residual.to(dtype), weight.to(dtype), at


def _probe(normed: torch.Tensor, residual_out: torch.Tensor, at: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = min(PROBES, normed.shape[0])
    return bits(normed[at:at + n]).clone(), bits(residual_out[at:at + n]).clone()


def _differs(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Elements of (normed, residual_out) whose bits differ between ``got`` and ``want`` (every row)."""
    return sum(int((bits(g) != bits(w)).sum()) for g, w in zip(got[:2], want))


def _sweep(rank, world, token_counts, with_residual, dtype):
    """Every path's probe bits per token count, and the recipe's from every rank's inputs."""
    fusion = make_fusion(HIDDEN, dtype, enabled=True, backend="torch", deterministic=True, max_tokens=LIMIT)
    status = fusion.status()
    out = {"status": status, "rows": {}, "picked": {}, "differs": {}}
    for tokens in token_counts:
        x, residual, weight, at = rank_rows(rank, tokens, HIDDEN, dtype)
        res = residual if with_residual else None
        parts = [rank_rows(r, tokens, HIDDEN, dtype)[0] for r in range(world)]
        recipe = reference.canonical_all_reduce_add_rms_norm(parts, res, weight, EPS)
        partial = PartialSum(pending=x.clone(), layer_id=0, op=fusion)
        outputs = {"dispatch": fusion.reduce_add_rms_norm(partial, _clone_or_none(res), weight, EPS)}
        out["picked"][tokens] = fusion.strategy(0, tokens).value
        for name in status["deterministic_strategies"]:
            if fusion.backends[Strategy(name)].fits(tokens):
                outputs[name] = fusion.run(Strategy(name), x.clone(), _clone_or_none(res), weight, EPS)
        out["rows"][tokens] = {"recipe": _probe(*recipe, at), **{k: _probe(*v[:2], at) for k, v in outputs.items()}}
        out["differs"].update({(k, tokens): _differs(v, recipe) for k, v in outputs.items() if _differs(v, recipe)})
    fusion.destroy()
    return out


def _assert_row_invariant(per_rank, token_counts):
    for result in per_rank:  # every row of every call is the recipe's, bit for bit
        assert not result["differs"], f"elements whose bits differ from the recipe: {result['differs']}"
    first = per_rank[0]["rows"][max(token_counts)]["recipe"]  # every probe row (T = 1 holds only the first)
    for result in per_rank:
        for tokens in token_counts:
            paths = result["rows"][tokens]
            n = min(PROBES, tokens)
            for name, (normed, residual_out) in paths.items():
                assert torch.equal(normed, first[0][:n]), f"T={tokens} {name}: normed bits differ"
                assert torch.equal(residual_out, first[1][:n]), f"T={tokens} {name}: residual bits differ"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no-residual"])
def test_two_ranks_rows_are_bit_identical_for_every_batch_and_strategy(with_residual, dtype):
    """fp32 too: there a different order of the sum of squares shows in almost every output
    (in bf16 most such differences round away, so bf16 alone could miss one)."""
    counts = TOKEN_COUNTS if with_residual and dtype == torch.bfloat16 else [1, 2, 3, 64, 99, 100, 101, 512]
    per_rank = run_distributed(_sweep, world_size=2, args=(counts, with_residual, dtype), timeout_s=480)
    status = per_rank[0]["status"]
    assert status["deterministic"] is True and status["active"], status
    assert status["deterministic_strategies"] == ["nccl", "torch"]
    assert "flashinfer_one_shot" in status["deterministic_excluded"]
    picked = per_rank[0]["picked"]
    assert {picked[t] for t in counts if t <= LIMIT} == {"torch"} and {picked[t] for t in counts if t > LIMIT} == {
        "nccl"}, "the dispatch must switch strategies across the cut-off for the test to cross it"
    for tokens in counts:
        assert {"recipe", "dispatch", "nccl"} <= set(per_rank[0]["rows"][tokens])
        assert ("torch" in per_rank[0]["rows"][tokens]) == (tokens <= LIMIT)
    _assert_row_invariant(per_rank, counts)


@pytest.mark.timeout(600)
def test_three_ranks_reduce_in_rank_order():
    counts = [1, 2, 5, 100, 101, 300]
    per_rank = run_distributed(_sweep, world_size=3, args=(counts, True, torch.float32), timeout_s=480)
    _assert_row_invariant(per_rank, counts)


def _default_mode_unchanged(rank, world):
    """Deterministic mode off: the torch and nccl strategies give the plain reference's bits."""
    fusion = make_fusion(HIDDEN, torch.bfloat16, enabled=True, backend="torch", max_tokens=LIMIT)
    status = fusion.status()
    x, residual, weight, _ = rank_rows(rank, 37, HIDDEN)
    parts = [rank_rows(r, 37, HIDDEN)[0] for r in range(world)]
    total = sum(p.float() for p in parts).to(torch.bfloat16)  # 2 ranks: one addition, one rounding
    expected = reference.add_rms_norm(total, residual, weight, EPS)
    same = all(
        torch.equal(bits(got), bits(want))
        for s in (Strategy.TORCH, Strategy.NCCL)
        for got, want in zip(fusion.run(s, x.clone(), residual.clone(), weight, EPS)[:2], expected))
    fusion.destroy()
    return status, same


def test_default_mode_keeps_the_plain_reference():
    status, same = run_distributed(_default_mode_unchanged, world_size=2)[0]
    assert status["deterministic"] is False and status["deterministic_strategies"] == []
    assert same


def test_config_keeps_fusion_on_in_deterministic_mode():
    config = FusionConfig(enabled=True, deterministic=True)
    assert config.deterministic and config.enabled


# ---- the unfused tail's Triton kernel, under the interpreter

KERNEL_CASES = [(1, 5, 96, torch.float32, True), (3, 4, 160, torch.float32, False), (1, 3, 128, torch.bfloat16, True),
                (4, 2, 64, torch.bfloat16, True)]  # (parts, tokens, hidden, dtype, with residual)


def _kernel_cases(rank, world):
    from arfusion.fusion.backends.kernels.reduce_add_rms_norm import reduce_add_rms_norm

    out = []
    for num_parts, tokens, hidden, dtype, with_residual in KERNEL_CASES:
        g = torch.Generator().manual_seed(num_parts * 100 + tokens)
        parts = (2 * torch.randn(num_parts, tokens, hidden, generator=g)).to(dtype)
        residual = (2 * torch.randn(tokens, hidden, generator=g)).to(dtype) if with_residual else None
        weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
        x = parts[0].clone()  # in place as the unfused path runs it: out over the input, residual_out over residual
        res_in = None if residual is None else residual.clone()
        out_t = x if num_parts == 1 and res_in is not None else torch.empty_like(x)
        res_out = res_in if res_in is not None else torch.empty_like(x)
        reduce_add_rms_norm(x[None] if num_parts == 1 else parts, res_in, out_t, res_out, weight, EPS)
        out.append((parts, residual, weight, out_t, res_out))
    return out


@pytest.mark.timeout(300)
def test_unfused_tail_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    from tests.dist_utils import run_under_triton_interpreter
    from tests.test_triton_elementwise import interpreter_cast

    for parts, residual, weight, normed, residual_out in run_under_triton_interpreter(_kernel_cases):
        dtype = parts.dtype
        acc = torch.zeros(parts.shape[1:], dtype=torch.float32)
        for part in parts:
            acc = acc + part.float()
        y = interpreter_cast(acc, dtype)
        res = y if residual is None else interpreter_cast(y.float() + residual.float(), dtype)
        assert torch.equal(bits(residual_out), bits(res)), "rank-order fp32 sum and residual add, bit for bit"
        rf = res.float()
        expected = rf / torch.sqrt((rf * rf).sum(-1, keepdim=True) / rf.shape[-1] + EPS) * weight.float()
        scale = expected.abs().clamp_min(1.0)
        assert ((normed.float() - expected).abs() <= 2 * torch.finfo(dtype).eps * scale).all()
