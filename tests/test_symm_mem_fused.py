"""The fused two-shot all-reduce + residual + RMSNorm kernels (fusion/backends/kernels/two_shot_norm.py)
under Triton's CPU interpreter, with W ranks as W processes (gloo): each rank's symmetric buffer
is a shared-memory file that every process maps, ``peer_ptrs`` holds their addresses in each
process, and a gloo barrier stands in for the symmetric-memory barrier between the two launches.
The ranks run launch 2 at the same time, so a rank's waiting programs really wait on the peers'
flags (each call runs twice on the same buffers: the flags must be back at 0 after each).

Checked per case (random inputs, several world sizes, shards that are short or empty):
- every rank returns the same output and residual, bit for bit, on both calls;
- every flag is 0 after each call;
- the residual equals the kernels' math in torch (fp32 sum in rank order from +0, one cast,
  fp32 add, one cast; the interpreter casts fp32 -> bf16 by truncation) bit for bit, and the
  output within two ulps of it (the interpreter's fp32 sum of squares runs in numpy's order);
- the residual within two ulps and the output within three of the reference (fusion/reference.py,
  round to nearest): each of the sum's, the residual add's and the output's casts may truncate
  where the reference rounds, one ulp each. Ulps are measured at the scale the roundings act
  on (|sum| + |residual|, and that scale through the norm).
The host side (layout, buffer size, refusal on CPU over gloo) is tested directly.
"""
import os

import pytest
import torch

pytest.importorskip("triton")

from arfusion.fusion import reference  # noqa: E402
from arfusion.fusion.backends.symm_mem_fused import (ShardLayout, SymmMemFusedBackend, buffer_elements,  # noqa: E402
                                   flags_offset, fused_unavailable_reason, gather_offset, output_tensors,
                                   push_shards, reduce_and_finish, row_chunks)
from arfusion.layers.parallel_state import get_tp_group  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.test_triton_elementwise import interpreter_cast  # noqa: E402

EPS = 1e-6
# (world, tokens, hidden, max_tokens, dtype, with residual)
CASES = [
    (2, 1, 64, 4, torch.bfloat16, True),  # fewer tokens than ranks: rank 1 owns nothing
    (2, 7, 96, 8, torch.bfloat16, True),  # odd split, hidden not a power of two
    (3, 7, 96, 9, torch.float32, True),
    (2, 5, 128, 5, torch.float16, False),  # first layer: no residual
    (4, 3, 64, 8, torch.bfloat16, True),  # the last rank's shard is empty
    (2, 16, 1000, 16, torch.bfloat16, True),
    (2, 9, 64, 4, torch.bfloat16, True),  # more rows than the buffer: chunks of 4, 4 and 1
    (3, 10, 64, 4, torch.float16, False),
]


def case_inputs(case):
    """Every rank's x, the residual and the weight of a case (the same in every process)."""
    world, tokens, hidden, _, dtype, with_residual = case
    g = torch.Generator().manual_seed(tokens * 100 + hidden + world)
    xs = [(2 * torch.randn(tokens, hidden, generator=g)).to(dtype) for _ in range(world)]
    residual = (2 * torch.randn(tokens, hidden, generator=g)).to(dtype) if with_residual else None
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    return xs, residual, weight


def _run_rank(rank, world, case, shm_dir):
    """This rank's two calls of the op on buffers shared with the other rank processes, chunk by
    chunk as `SymmMemFusedBackend` does; returns each call's (out, residual_out) and
    whether every flag was 0 after it."""
    _, tokens, hidden, max_tokens, dtype, _ = case
    xs, residual, weight = case_inputs(case)
    size = torch.empty((), dtype=dtype).element_size()
    elements = buffer_elements(max_tokens, hidden, world, size)
    files = [os.path.join(shm_dir, f"rank{q}") for q in range(world)]
    mine = torch.from_file(files[rank], shared=True, size=elements, dtype=dtype)
    mine.fill_(float("nan"))
    gather_at = gather_offset(max_tokens, hidden, world)
    flags_at = flags_offset(max_tokens, hidden, world, size)
    flags = mine.view(torch.uint8)[flags_at * 4:(flags_at + max_tokens) * 4].view(torch.int32)
    flags.zero_()
    group = get_tp_group()
    group.all_agree(True)  # every buffer initialised before any rank maps and writes it
    buffers = [torch.from_file(f, shared=True, size=elements, dtype=dtype) for f in files]
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    calls = []
    for _ in range(2):
        x, res_in = xs[rank].clone(), None if residual is None else residual.clone()
        out, residual_out = output_tensors(x, res_in)
        for rows in row_chunks(tokens, max_tokens):
            layout = ShardLayout(rows.stop - rows.start, world, rank)
            chunk_res = None if res_in is None else res_in[rows]
            push_shards(x[rows], ptrs, layout)
            group.all_agree(True)  # the barrier
            reduce_and_finish(x[rows], chunk_res, out[rows], residual_out[rows], weight, EPS, ptrs, layout,
                              gather_at, flags_at)
        in_place = (out if residual is not None else residual_out).data_ptr() == x.data_ptr()
        calls.append((out, residual_out, in_place, not flags.any().item()))
        group.all_agree(True)  # the next call's barrier orders its pushes after these reads
    return calls


def kernel_math(xs, residual, weight, max_tokens):
    """The kernels' math in torch with the interpreter's casts (rows owned per chunk)."""
    world, (tokens, _) = len(xs), xs[0].shape
    acc = torch.empty(xs[0].shape, dtype=torch.float32)
    for row in range(tokens):
        chunk = row_chunks(tokens, max_tokens)[row // max_tokens]
        shard = -(-(chunk.stop - chunk.start) // world)
        owner = (row - chunk.start) // shard
        assert 0 <= owner < world
        total = torch.zeros_like(xs[0][row], dtype=torch.float32)
        for sender in range(world):  # rank order from +0, whichever rank owns the row
            total = total + xs[sender][row].float()
        acc[row] = total
    y = interpreter_cast(acc, xs[0].dtype)
    res = y if residual is None else interpreter_cast(y.float() + residual.float(), y.dtype)
    resf = res.float()
    inv_rms = 1.0 / torch.sqrt((resf * resf).sum(-1, keepdim=True) / resf.shape[-1] + EPS)
    return interpreter_cast(resf * inv_rms * weight.float(), y.dtype), res


def ulps(a, b, scale):
    """|a - b| in units of the dtype's eps at ``scale`` (elementwise max)."""
    return ((a.float() - b.float()).abs() / (torch.finfo(a.dtype).eps * scale)).max().item()


def _check_case(case, ranks):
    """Compare every rank's two calls (``_run_rank`` results) with the emulation and the reference."""
    xs, residual, weight = case_inputs(case)
    max_tokens = case[3]
    emulated_out, emulated_res = kernel_math(xs, residual, weight, max_tokens)
    total = sum(x.float() for x in xs)
    ref_out, ref_res = reference.add_rms_norm(total.to(xs[0].dtype), residual, weight, EPS)
    out0, res0 = ranks[0][0][:2]
    # the magnitude the sum's and the residual add's roundings act on, and its image through the norm
    res_scale = (total.abs() + (0 if residual is None else residual.float().abs())).clamp_min(1.0)
    ref_inv_rms = torch.rsqrt(ref_res.float().pow(2).mean(-1, keepdim=True) + EPS)
    out_scale = (res_scale * ref_inv_rms * weight.float().abs()).clamp_min(1.0)
    calls = [call for rank in ranks for call in rank]
    return {
        "ranks_and_calls_agree": all(torch.equal(o, out0) and torch.equal(r, res0) for o, r, _, _ in calls),
        "in_place": all(in_place for _, _, in_place, _ in calls),
        "flags_down": all(down for _, _, _, down in calls),
        "res_vs_emulated": ulps(res0, emulated_res, res_scale),
        "out_vs_emulated": ulps(out0, emulated_out, out_scale),
        "res_vs_reference": ulps(res0, ref_res, res_scale),
        "out_vs_reference": ulps(out0, ref_out, out_scale),
        "finite": all(torch.isfinite(o).all().item() and torch.isfinite(r).all().item() for o, r, _, _ in calls),
    }


def _rank_cases(rank, world, cases, shm_root):
    out = []
    for i, case in enumerate(cases):
        shm_dir = os.path.join(shm_root, f"case{i}")
        if rank == 0:
            os.makedirs(shm_dir, exist_ok=True)
        get_tp_group().all_agree(True)
        out.append(_run_rank(rank, world, case, shm_dir))
    return out


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """Per case, ``_check_case`` of its ranks' results; one process group per world size."""
    shm_root = tmp_path_factory.mktemp("symm_buffers")
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported in the spawned ranks
    try:
        checked = {}
        for world in sorted({c[0] for c in CASES}):
            cases = [c for c in CASES if c[0] == world]
            ranks = run_distributed(_rank_cases, world_size=world, args=(cases, str(shm_root / f"w{world}")),
                                    timeout_s=300)
            for i, case in enumerate(cases):
                checked[CASES.index(case)] = _check_case(case, [r[i] for r in ranks])
        return checked
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"W{c[0]}-T{c[1]}-H{c[2]}-{str(c[4])[6:]}-res{c[5]}" for c in CASES])
def test_fused_two_shot_kernels_match_the_reference(interpreted, index):
    r = interpreted[index]
    assert r["finite"] and r["ranks_and_calls_agree"] and r["in_place"] and r["flags_down"], r
    assert r["res_vs_emulated"] == 0, r
    assert r["out_vs_emulated"] <= 2, r
    assert r["res_vs_reference"] <= 2 and r["out_vs_reference"] <= 3, r


def test_shard_layout_covers_every_row_once():
    for tokens in (1, 2, 3, 7, 64, 4097):
        for world in (2, 3, 4, 8):
            layouts = [ShardLayout(tokens, world, r) for r in range(world)]
            rows = [i for lay in layouts for i in range(lay.own_start, lay.own_start + lay.own_rows)]
            assert rows == list(range(tokens)), (tokens, world)
            assert all(lay.own_rows + lay.peer_rows == tokens and lay.own_rows <= lay.shard_rows for lay in layouts)


def test_row_chunks_cover_the_batch_in_buffer_sized_pieces():
    assert row_chunks(9, 4) == [slice(0, 4), slice(4, 8), slice(8, 9)]
    assert row_chunks(4, 4) == [slice(0, 4)] and row_chunks(1, 4096) == [slice(0, 1)]


def test_buffer_holds_scatter_slots_then_gathered_rows_then_flags():
    assert gather_offset(4096, 4096, 2) == 4096 * 4096
    assert flags_offset(4096, 4096, 2, 2) == 2 * 4096 * 4096 * 2 // 4
    assert buffer_elements(4096, 4096, 2, 2) == 2 * 4096 * 4096 + 4096 * 2  # bf16: two elements per flag
    assert buffer_elements(7, 64, 4, 4) == 4 * 2 * 64 + 7 * 64 + 7
    # 2 x 2 + 3 fp16 elements (14 bytes) of data: the flags start at byte 16, the next 4-byte boundary
    assert flags_offset(3, 1, 2, 2) == 4 and buffer_elements(3, 1, 2, 2) == (4 + 3) * 2


def test_hidden_past_one_row_per_program_is_refused_by_name():
    assert fused_unavailable_reason(4096) is None
    assert "exceeds" in fused_unavailable_reason(1 << 20)


def _fused_on_cpu(rank, world_size):
    fused = SymmMemFusedBackend(get_tp_group())
    ok = fused.ensure(16, 64, torch.float32)
    x = torch.randn(4, 64)
    try:
        fused.run(x, None, torch.ones(64), EPS)
        call_error = None
    except ValueError as exc:
        call_error = str(exc)
    return ok, fused.fits(4), fused.failure, call_error


def test_fused_strategy_is_refused_together_on_cpu_and_a_call_says_why():
    results = run_distributed(_fused_on_cpu)
    for ok, fits, failure, call_error in results:
        assert not ok and not fits
        assert "rank 0" in failure and "rank 1" in failure and "CUDA device" in failure
        assert "symm_mem_fused cannot take" in call_error and "no buffer" in call_error
