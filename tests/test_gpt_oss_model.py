"""gpt-oss against transformers' ``GptOssForCausalLM`` on the CPU, fp32: the tiny random model of
tests/gpt_oss_checkpoints.py loaded from its bf16 and its MXFP4 checkpoint (MXFP4 experts
dequantized at load and kept in MXFP4), at TP1 and at TP2 over gloo with fusion on (torch
backend), through tests/model_scenario.py's steps: a prefill with a prompt chunked after a cached
prefix, a mixed step and 8 greedy decode steps, prompts longer than the sliding window.

Every logits row against transformers' logits at that (sequence, position), from one forward over
the whole final sequence: max |ours - theirs| <= 1e-3 * max |theirs| (RELATIVE); the greedy
tokens equal transformers' argmax. Also: our quantizer's blocks and scales dequantize, in
transformers' own ``convert_moe_packed_tensors``, to the values our dequantizer gives, bit for bit.
"""
import pytest
import torch

pytest.importorskip("transformers")

from arfusion.engine.models.registry import build_model  # noqa: E402
from arfusion.engine.weights.safetensors_loader import load_safetensors  # noqa: E402
from arfusion.layers.moe.mxfp4 import dequantize_mxfp4, quantize_mxfp4  # noqa: E402
from tests.dist_utils import make_fusion, run_distributed  # noqa: E402
from tests.gpt_oss_checkpoints import build_checkpoints  # noqa: E402
from tests.model_scenario import PROMPTS, run_scenario  # noqa: E402

RELATIVE = 1e-3
DECODE_STEPS = 8
NUM_SLOTS = 96
FORMS = ["bf16", "mxfp4-dequantized", "mxfp4-kept"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory.mktemp("gpt-oss"))


def _worker(rank: int, world: int, paths: dict) -> dict:
    import dataclasses

    results = {}
    for form, path in paths.items():
        config, weights = load_safetensors(path, torch.float32)
        config = dataclasses.replace(config, keep_mxfp4=form == "mxfp4-kept")
        fusion = make_fusion(config.hidden_size, **({"enabled": True, "backend": "torch"} if world > 1 else {}))
        model = build_model(config, fusion)
        model.load_weights(weights)
        results[form] = run_scenario(model, fusion, NUM_SLOTS, DECODE_STEPS)
        results[form]["shares"] = _gathered_share(model)
    return results


def _gathered_share(model: torch.nn.Module) -> list:
    """Every rank's ``GptOssExperts.local`` (its share of an expert's intermediate features)."""
    import torch.distributed as dist

    local = next(m.local for m in model.modules() if hasattr(m, "w13_bias"))
    if not dist.is_initialized():
        return [local]
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, local)
    return shares


def _check_against_transformers(hf_model, result: dict) -> None:
    tokens = result["tokens"]
    with torch.no_grad():
        theirs = [hf_model(torch.tensor([seq])).logits[0] for seq in tokens]
    expected = torch.stack([theirs[s][pos] for s, pos in result["rows"]])
    ours = result["logits"]
    error = (ours - expected).abs().max() / expected.abs().max()
    print(f"max |ours - transformers| / max |transformers| = {error:.2e}")
    assert error <= RELATIVE, f"max |ours - transformers| = {error:.2e} of max |transformers|"
    for s, seq in enumerate(tokens):  # each generated token is transformers' argmax at the position before it
        generated = [pos for t, pos in result["rows"] if t == s and len(PROMPTS[s]) <= pos + 1 < len(seq)]
        assert len(generated) >= DECODE_STEPS
        assert [seq[pos + 1] for pos in generated] == [int(theirs[s][pos].argmax()) for pos in generated]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2])
def test_logits_and_greedy_tokens_match_transformers(checkpoints, world):
    hf_model, bf16_dir, mxfp4_dir = checkpoints
    paths = {"bf16": str(bf16_dir), "mxfp4-dequantized": str(mxfp4_dir), "mxfp4-kept": str(mxfp4_dir)}
    results = run_distributed(_worker, world_size=world, args=(paths,), timeout_s=400)
    for form in FORMS:
        _check_against_transformers(hf_model, results[0][form])
        if world > 1:
            assert results[0][form]["fused"] > 0, "fusion on: some reductions run fused"
            assert results[0][form]["tokens"] == results[1][form]["tokens"]


@pytest.mark.timeout(600)
def test_mxfp4_kept_pads_a_rank_share_that_is_not_whole_groups(tmp_path):
    """Experts of intermediate 96 at TP2: 48 features a rank, not whole groups of 32, so each rank
    holds 64 (rank 1: features 64..95 and 32 of zeros, `rank_share`); the kept MXFP4 model still
    matches transformers, as does the same checkpoint dequantized at load (48 features a rank)."""
    hf_model, _, mxfp4_dir = build_checkpoints(tmp_path, intermediate_size=96)
    paths = {"mxfp4-kept": str(mxfp4_dir), "mxfp4-dequantized": str(mxfp4_dir)}
    results = run_distributed(_worker, world_size=2, args=(paths,), timeout_s=400)
    for form in paths:
        _check_against_transformers(hf_model, results[0][form])
        assert results[0][form]["tokens"] == results[1][form]["tokens"]
    assert results[0]["mxfp4-kept"]["shares"] == [64, 64], "each rank's share padded to two groups"
    assert results[0]["mxfp4-dequantized"]["shares"] == [48, 48]


def test_a_checkpoint_of_neither_form_is_refused_in_one_line(checkpoints, tmp_path):
    """bf16 experts under an mxfp4 quantization_config, and a quantization the loader does not know."""
    import json
    import shutil

    from arfusion.engine.weights.errors import ModelFileError

    _, bf16_dir, mxfp4_dir = checkpoints
    mixed, other = tmp_path / "mixed", tmp_path / "other"
    shutil.copytree(bf16_dir, mixed)
    shutil.copy(mxfp4_dir / "config.json", mixed / "config.json")
    shutil.copytree(mxfp4_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (other / "config.json").write_text(json.dumps(config))
    for path, fragment in ((mixed, "unexpected tensor"), (other, "quantization_config 'fp8' is not supported")):
        with pytest.raises(ModelFileError) as info:
            load_safetensors(path, torch.float32)
        assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("shape", [(3, 8, 64), (2, 5, 96)])
def test_quantizer_round_trips_through_transformers_dequantization(shape):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    weight = torch.randn(shape, generator=torch.Generator().manual_seed(shape[1])) * 0.3
    blocks, scales = quantize_mxfp4(weight)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(ours, theirs)
    assert (ours - weight).abs().max() <= weight.abs().max() / 6  # a step of E2M1 near its top, at most


def test_rank_share_pads_mxfp4_to_whole_groups():
    from arfusion.layers.moe.gpt_oss_moe import rank_share

    assert rank_share(2880, 4, mxfp4=True) == 736  # 720 is 22.5 groups of 32
    assert rank_share(2880, 4, mxfp4=False) == 720
    assert rank_share(2880, 2, mxfp4=True) == 1440
    assert rank_share(64, 8, mxfp4=True) == 32  # ranks 2..7 hold zeros only
    with pytest.raises(ValueError, match="multiple of 32"):
        rank_share(2890, 2, mxfp4=True)
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size"):
        rank_share(2880, 7, mxfp4=False)
