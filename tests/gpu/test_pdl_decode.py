"""Programmatic dependent launch (``--enable-pdl``, layers/kernels/pdl.py) on one GPU of sm90 or
newer: the same bits as without it, run to run.

Engine: ``tiny-moe`` (Qwen3-MoE blocks, 8 experts top-2) in bf16 at batch 1, whose decode step
runs every kernel that takes part but the MXFP4 experts': the skinny o projection (through the
launch cache), rotary + q/k norm + KV store, decode attention with its combine (a context of
256: several splits, two of them holding keys by the end), the one-launch routing and the two
matrix-vector expert launches. One prompt of PROMPT_LEN tokens, STEPS greedy decode steps, each
runner decoding its own tokens: eagerly and replayed from a CUDA graph, PDL off and on. Per
mode, the two runs' tokens and logits must be equal bit for bit; then the last decode step is
run REPEATS more times (the same token at the same position and KV slot: the same inputs), and
every repeat's logits must equal that step's bits: a kernel that read its predecessor's output
before it was complete, or wrote over what the predecessor still read, would change some. Without
either flag (``--pdl-max-batch`` 1, the default) the batch-1 decode takes PDL too, with the bits
of ``--pdl-max-batch 0``. Also
with ``--norm-into-qkv`` (the input norm inside the q/k/v launch, which takes part too), and with
it and ``--norm-into-route`` (the post-attention norm inside the routing launch, too).

MXFP4 experts (gpt-oss's matrix-vector launches, layers/moe/kernels/triton_mxfp4_gemv.py): 4
experts of hidden and intermediate 1024, one token, top 4, captured with PDL on in a CUDA graph
behind the copy of its inputs, replayed REPEATS times over INPUTS different tokens and routings:
every replay's output equals that input's eager output with PDL off, bit for bit.
"""
import pytest
import torch

from tests.dist_utils import run_distributed

pytest.importorskip("triton")

pytestmark = [pytest.mark.gpus(1), pytest.mark.timeout(900)]

PROMPT_LEN, STEPS, CONTEXT, REPEATS, INPUTS = 100, 24, 256, 200, 8


def _require_sm90() -> None:
    major, minor = torch.cuda.get_device_capability(0)
    if major < 9:
        pytest.skip(f"programmatic dependent launch needs sm90 or newer, found sm{major}{minor}")


def _decode(rank: int, world: int, graphs: bool, pdl: str, fold: str) -> dict:
    """Logits ``[1 + STEPS, 1, vocab]`` and tokens of one greedy generation, then the last step's
    logits repeated ``[REPEATS, 1, vocab]``; whether the launch cache kept a PDL kernel. ``pdl``:
    "on" (``--enable-pdl``), "off" (``--pdl-max-batch 0``) or "default" (neither: PDL at batch 1).
    ``fold``: the norms folded into the launch after them ("", "qkv", "qkv+route"), "+rotary" the
    rotary embedding into the attention's."""
    from arfusion.engine.runtime.model_runner import RunnerSettings
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.engine.scheduling.static_batch import StaticBatch, random_prompts
    from arfusion.layers.kernels.triton_skinny_matmul import SKINNY_LAUNCHER
    from arfusion.layers.parallel_state import get_tp_group

    settings = RunnerSettings(model_path="tiny-moe", dtype="bfloat16", context_length=CONTEXT, max_running_requests=2,
                              cuda_graph_max_bs=1, disable_cuda_graph=not graphs, enable_pdl=pdl == "on",
                              pdl_max_batch=0 if pdl == "off" else 1, kv_slots=1024,
                              norm_into_qkv="qkv" in fold, norm_into_route="route" in fold,
                              rotary_into_attention="rotary" in fold)
    runner = build_runner(settings, get_tp_group())
    assert (runner.graphs is not None) == graphs
    batch = StaticBatch(runner, random_prompts(1, PROMPT_LEN, runner.config.vocab_size, seed=3), STEPS + 1)
    logits = [batch.prefill(gather_logits=True).full.clone()]
    tokens = [logits[-1].argmax(-1).tolist()]
    for _ in range(STEPS):
        logits.append(batch.decode(tokens[-1], gather_logits=True).full.clone())
        tokens.append(logits[-1].argmax(-1).tolist())
    repeats = []
    for _ in range(REPEATS):
        batch.seq_lens = [n - 1 for n in batch.seq_lens]  # the last step again: same token, position, slot
        repeats.append(batch.decode(tokens[-2], gather_logits=True).full.clone())
    torch.cuda.synchronize()
    kept_pdl = any(compiled.metadata.launch_pdl for compiled in SKINNY_LAUNCHER._compiled.values())
    runner.destroy()
    return {"logits": torch.stack(logits).cpu(), "tokens": tokens, "repeats": torch.stack(repeats).cpu(),
            "kept_pdl": kept_pdl}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of fp32 or bf16 ``t``, as integers (NaNs and zeros' signs compared too)."""
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.parametrize("fold", ["", "qkv", "qkv+route", "qkv+route+rotary"],
                         ids=["separate-norm", "norm-into-qkv", "norm-into-qkv-and-route", "every-fold"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graph"])
def test_decode_with_pdl_has_the_bits_of_decode_without(graphs, fold):
    _require_sm90()
    runs = {pdl: run_distributed(_decode, world_size=1, args=(graphs, pdl, fold), device_kind="cuda",
                                 timeout_s=600)[0] for pdl in ("off", "on")}
    off, on = runs["off"], runs["on"]
    assert on["kept_pdl"] and not off["kept_pdl"]
    assert on["tokens"] == off["tokens"]
    assert torch.equal(_bits(on["logits"]), _bits(off["logits"]))
    for run in (off, on):
        last = _bits(run["logits"][-1])
        changed = [i for i, r in enumerate(run["repeats"]) if not torch.equal(_bits(r), last)]
        assert not changed, f"repeats {changed[:10]} of the last step changed its logits"


def _mxfp4_experts(rank: int, world: int) -> dict:
    """(eager outputs with PDL off per input, every graph replay's output with PDL on)."""
    from arfusion.layers.kernels import pdl
    from arfusion.layers.moe.gpt_oss_moe import GptOssExperts
    from arfusion.layers.moe.kernels.mxfp4_moe_config import GEMV_CONFIG
    from arfusion.layers.moe.kernels.triton_mxfp4_moe import gpt_oss_experts_triton
    from tests.test_gpt_oss_moe_triton import fill_experts

    pdl.require_supported(torch.device("cuda", 0))
    experts = GptOssExperts(4, 1024, 1024, 1.702, 7.0, True, torch.bfloat16, None)
    fill_experts(experts, 7)
    experts.cuda()
    g = torch.Generator().manual_seed(11)
    xs = (torch.randn(INPUTS, 1, 1024, generator=g) * 0.5).to(torch.bfloat16).cuda()
    ids = torch.stack([torch.randperm(4, generator=g)[None] for _ in range(INPUTS)]).to(torch.int32).cuda()
    weights = torch.softmax(torch.randn(INPUTS, 1, 4, generator=g), -1).cuda()
    eager = [gpt_oss_experts_triton(xs[i], experts, weights[i], ids[i], GEMV_CONFIG) for i in range(INPUTS)]
    source = [xs[0].clone(), ids[0].clone(), weights[0].clone()]
    static = [t.clone() for t in source]
    with pdl.pdl_mode(True):
        gpt_oss_experts_triton(static[0], experts, static[2], static[1], GEMV_CONFIG)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for dst, src in zip(static, source):
                dst.copy_(src)
            out = gpt_oss_experts_triton(static[0], experts, static[2], static[1], GEMV_CONFIG)
    replays = []
    for r in range(REPEATS):
        i = r % INPUTS
        for dst, src in zip(source, (xs[i], ids[i], weights[i])):
            dst.copy_(src)
        graph.replay()
        replays.append(out.clone())
    torch.cuda.synchronize()
    return {"eager": torch.stack(eager).cpu(), "replays": torch.stack(replays).cpu()}


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graph"])
def test_the_default_takes_pdl_at_batch_1_with_the_bits_without(graphs):
    _require_sm90()
    off, default = (run_distributed(_decode, world_size=1, args=(graphs, pdl, ""), device_kind="cuda",
                                    timeout_s=600)[0] for pdl in ("off", "default"))
    assert default["kept_pdl"] and not off["kept_pdl"]
    assert default["tokens"] == off["tokens"]
    assert torch.equal(_bits(default["logits"]), _bits(off["logits"]))


def test_mxfp4_experts_with_pdl_replay_the_bits_without():
    _require_sm90()
    r = run_distributed(_mxfp4_experts, world_size=1, device_kind="cuda", timeout_s=600)[0]
    changed = [i for i, out in enumerate(r["replays"]) if not torch.equal(_bits(out), _bits(r["eager"][i % INPUTS]))]
    assert not changed, f"replays {changed[:10]} differ from the eager output without PDL"
