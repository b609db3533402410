"""Attention with learned sinks and a sliding window (gpt-oss): the torch path
(layers/sink_attention.py) against a plain softmax over the scores with the sink logit appended,
and the Triton decode and extend kernels' ``sinks`` / ``window`` options against the torch path
under Triton's CPU interpreter (one spawned child with TRITON_INTERPRET=1; skipped without
triton). fp32 throughout; tolerances from tests/tolerances.py. The windows are shorter than the
sequences and than the kernels' key blocks, and some are not multiples of them, so blocks with
no visible key for some rows occur (their running sums must stay as they were)."""
import pytest
import torch

from arfusion.layers.sink_attention import attend_with_sinks, visible_keys
from tests.dist_utils import run_under_triton_interpreter
from tests.tolerances import TOLERANCES

RTOL, ATOL = TOLERANCES[torch.float32]
# (kv heads, group, head dim, prompt / decode lengths, window, with sinks)
CASES = [(2, 2, 16, (9, 40, 3), 4, True), (1, 4, 32, (70, 17), 0, True), (2, 1, 16, (33, 5), 7, False),
         (2, 2, 16, (100,), 20, True)]


def _plain(q, keys, values, q_pos, scale, sinks, window):
    """softmax over [scores, sink] (the sink's column dropped after), fp64, one query at a time."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    visible = visible_keys(q_pos, keys.shape[0], window)
    for i in range(q.shape[0]):
        scores = torch.einsum("hd,nhd->hn", q[i].double(), k) * scale
        scores = scores.masked_fill(~visible[i], float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
        probs = torch.softmax(scores, dim=1)[:, :keys.shape[0]]
        out[i] = torch.einsum("hn,nhd->hd", probs, v)
    return out


def _case(kv_heads, group, dim, lengths, window, with_sinks, seed):
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    slots = sum(lengths) + 5
    k_cache = torch.randn(slots, kv_heads, dim, generator=g)
    v_cache = torch.randn(slots, kv_heads, dim, generator=g)
    perm = torch.randperm(slots, generator=g)
    width = max(lengths)
    req_to_token = torch.zeros(len(lengths), width, dtype=torch.int64)
    start = 0
    for i, n in enumerate(lengths):
        req_to_token[i, :n] = perm[start:start + n]
        start += n
    sinks = torch.randn(heads, generator=g) * 2 if with_sinks else None
    return k_cache, v_cache, req_to_token, torch.tensor(lengths), sinks, g


@pytest.mark.parametrize("window", [0, 3, 64])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_torch_path_matches_plain_softmax(window, with_sinks):
    g = torch.Generator().manual_seed(window)
    q, keys, values = torch.randn(12, 4, 16, generator=g), torch.randn(12, 2, 16, generator=g), torch.randn(12, 2, 16, generator=g)
    sinks = torch.randn(4, generator=g) if with_sinks else None
    q_pos = torch.arange(12)
    out = attend_with_sinks(q, keys, values, q_pos, 0.3, sinks, window)
    torch.testing.assert_close(out.double(), _plain(q, keys, values, q_pos, 0.3, sinks, window), rtol=RTOL, atol=ATOL)


def _interpreted(rank: int, world: int) -> dict:
    import triton

    from arfusion.layers.kernels.triton_decode_attention import decode_attention
    from arfusion.layers.kernels.triton_extend_attention import extend_attention

    assert triton.knobs.runtime.interpret
    results = {}
    for seed, (kv_heads, group, dim, lengths, window, with_sinks) in enumerate(CASES):
        k_cache, v_cache, req_to_token, seq_lens, sinks, g = _case(kv_heads, group, dim, lengths, window, with_sinks, seed)
        heads, scale = kv_heads * group, dim ** -0.5
        decode_q = torch.randn(len(lengths), heads, dim, generator=g)
        expected = torch.stack([attend_with_sinks(decode_q[i:i + 1], k_cache[req_to_token[i, :n]], v_cache[req_to_token[i, :n]],
                                                  torch.tensor([n - 1]), scale, sinks, window)[0]
                                for i, n in enumerate(lengths)])
        for splits in (1, 3, None):  # None: the shape-based choice, over the window's keys where it is narrower
            out = decode_attention(decode_q, k_cache, v_cache, req_to_token, seq_lens, scale, num_splits=splits,
                                   block=16, sinks=sinks, window=window)
            results[("decode", seed, splits)] = (out, expected)
        extend_lens = torch.tensor([max(1, n - n // 3) for n in lengths])  # a cached prefix of n // 3 keys
        q = torch.randn(int(extend_lens.sum()), heads * dim, generator=g)
        expected, start = [], 0
        for i, (n, new) in enumerate(zip(lengths, extend_lens.tolist())):
            slots = req_to_token[i, :n]
            expected.append(attend_with_sinks(q[start:start + new].view(new, heads, dim), k_cache[slots], v_cache[slots],
                                              torch.arange(n - new, n), scale, sinks, window))
            start += new
        for mask_all in (False, True):
            out = extend_attention(q, k_cache, v_cache, req_to_token, seq_lens, extend_lens, scale, block_m=16,
                                   block_n=16, mask_all=mask_all, sinks=sinks, window=window)
            results[("extend", seed, mask_all)] = (out, torch.cat(expected))
    return results


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    return run_under_triton_interpreter(_interpreted)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", range(len(CASES)))
@pytest.mark.parametrize("kernel", ["decode", "extend"])
def test_triton_kernels_match_torch_path(interpreted, kernel, seed):
    """Decode with one split, three and the shape-based count; extend after a cached prefix, with and without every
    block masked (batch-invariant mode)."""
    for key, (out, expected) in interpreted.items():
        if key[:2] == (kernel, seed):
            torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{key}: {m}")
