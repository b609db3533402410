"""The decode attention's combine in its split launch (`decode_attention(..., combine_in_split=True)`,
layers/kernels/triton_decode_attention.py: the last split program of each (row, kv head) combines,
counting arrivals) against the combine launch, under Triton's CPU interpreter (one spawned child;
skipped without triton), fp32 / fp16.

The two compute each output with the same code (`combine_splits`), so they agree bit for bit:
ragged rows of one split (written directly), several and every split; sinks with a window;
batch-invariant mode's fixed keys per split; rows read through row ids. After each call every
arrival counter is zero again, and the outputs match the fp32 reference (the tolerances of
tests/tolerances.py). The interpreter runs programs one after another, so this checks the
arithmetic and the counting, not the GPU's memory ordering (tests/gpu/test_triton_decode_attention.py
replays it in CUDA graphs)."""
import pytest
import torch

from tests.attention_cases import PAD_SLOT
from tests.dist_utils import run_under_triton_interpreter
from tests.tolerances import TOLERANCES

pytest.importorskip("triton")

# name: (dtype, group, kv heads, seq_lens at width 700, decode_attention's other arguments)
CASES = {
    "8 splits, ragged": (torch.float32, 2, 2, (1, 64, 65, 129, 520, 700), dict(num_splits=8)),
    "64 splits, fp16": (torch.float16, 4, 2, (1, 2, 64, 130, 700, 700), dict(num_splits=64)),
    "sinks and a window of 100": (torch.float32, 2, 2, (3, 90, 300, 700), dict(num_splits=6, window=100)),
    "fixed keys per split": (torch.float32, 2, 1, (1, 64, 300, 700), dict(keys_per_split=128, block=64)),
    "row ids": (torch.float16, 2, 2, (5, 400, 700), dict(num_splits=4, row_ids=True)),
}


def _inputs(dtype: torch.dtype, group: int, kv_heads: int, lens: tuple, seed: int):
    g = torch.Generator().manual_seed(seed)
    batch, heads, dim, width = len(lens), group * kv_heads, 64, 700
    slots = batch * width + 3
    q = torch.randn(batch, heads, dim, generator=g).to(dtype)
    k_cache, v_cache = (torch.randn(slots, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    table = torch.full((batch, width), PAD_SLOT, dtype=torch.int64)
    for b, n in enumerate(lens):
        table[b, :n] = torch.randperm(slots, generator=g)[:n]
    table[table == PAD_SLOT] = 0
    return q, k_cache, v_cache, table, torch.tensor(lens), torch.randn(heads, generator=g)


def _interpreted(rank: int, world: int) -> dict:
    from arfusion.layers.kernels.triton_decode_attention import ARRIVALS, decode_attention, decode_attention_reference
    from arfusion.layers.sink_attention import attend_with_sinks

    results = {}
    for seed, (name, (dtype, group, kv_heads, lens, options)) in enumerate(CASES.items()):
        q, k_cache, v_cache, table, seq_lens, sinks = _inputs(dtype, group, kv_heads, lens, seed)
        options = dict(options)
        row_ids = None
        if options.pop("row_ids", False):  # the rows in reverse order of a table twice as tall
            row_ids = torch.arange(len(lens) - 1, -1, -1) * 2
            wide = torch.zeros(2 * len(lens), table.shape[1], dtype=table.dtype)
            wide[row_ids] = table
            table = wide
        if "window" in options:
            options["sinks"] = sinks
        outs = [decode_attention(q, k_cache, v_cache, table, seq_lens, 0.3, row_ids=row_ids, combine_in_split=in_split,
                                 **options) for in_split in (False, True)]
        rows = table if row_ids is None else table[row_ids]
        if "window" in options:  # each row's query at its last position over its own keys
            expected = torch.cat([attend_with_sinks(q[b:b + 1], k_cache[rows[b, :n]], v_cache[rows[b, :n]],
                                                    torch.tensor([n - 1]), 0.3, sinks, options["window"])
                                  for b, n in enumerate(lens)])
        else:
            expected = decode_attention_reference(q, k_cache, v_cache, rows, seq_lens, 0.3)
        results[name] = (*outs, expected, int(ARRIVALS.get(q.device, 1).count_nonzero()))
    return results


@pytest.fixture(scope="module")
def interpreted():
    return run_under_triton_interpreter(_interpreted, timeout_s=400)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("name", list(CASES))
def test_the_combine_in_the_split_launch_gives_the_combine_launchs_bits(interpreted, name):
    separate, in_split, expected, nonzero_counters = interpreted[name]
    assert torch.equal(in_split, separate)
    rtol, atol = TOLERANCES[CASES[name][0]]
    torch.testing.assert_close(in_split.float(), expected.float(), rtol=rtol, atol=atol)
    assert nonzero_counters == 0


def test_the_benchmark_refuses_rows_longer_than_its_table():
    from arfusion.benchmarks.kernels.bench_decode_combine import main

    with pytest.raises(SystemExit) as info:
        main(["--seq-len", "9000", "--width", "8192"])
    assert info.value.code == 2
