"""MXFP4 scales the kernels would decode wrong are refused at load, naming the tensor.

The kernels that keep gpt-oss's experts in MXFP4 build each scale's power of two from its byte:
the CUDA-core decoders' fp32 ``(scale + 14) << 23`` is finite up to byte 240 (2^113), the
tensor-core decoder's bf16 2^(scale - 1) up to byte 128 (2^1); byte 255 is E8M0's NaN. The tiny
MXFP4 checkpoint of tests/gpt_oss_checkpoints.py, with one scale byte of one expert tensor
changed, loaded at TP1 in each form:

- kept: 240 loads; 241 is refused (2^114 exceeds 2^113), the message naming the tensor and the
  dequantized form; 255 is refused as NaN.
- kept for the tensor cores: 128 loads; 129 is refused (2^2 exceeds 2^1), the message naming the
  kept form (which takes it) as well.
- dequantized: 255 is refused as NaN; 250 loads in fp32 but is refused in fp16, where its
  weights (up to 6 * 2^123) exceed the range.
"""
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from arfusion.layers.moe.mxfp4 import (KEPT_MAX_SCALE, NAN_SCALE, TENSOR_CORE_MAX_SCALE,  # noqa: E402
                                       scale_problem)
from tests.dist_utils import run_distributed  # noqa: E402
from tests.gpt_oss_checkpoints import build_checkpoints  # noqa: E402

TENSOR = "model.layers.2.mlp.experts.down_proj_scales"


def test_scale_problem_names_nan_bytes_and_bytes_past_the_limit():
    scales = torch.randint(110, 130, (4, 6, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    scales[0, 0, 0] = 129
    assert scale_problem(scales, 129) is None
    assert "2^2, exceeds 2^1" in scale_problem(scales, TENSOR_CORE_MAX_SCALE)
    scales[1, 2, 0] = scales[3, 5, 2] = NAN_SCALE
    assert "2 of its 72 scale bytes are 255, E8M0's NaN" in scale_problem(scales, KEPT_MAX_SCALE)
    assert scale_problem(torch.empty(0, dtype=torch.uint8), KEPT_MAX_SCALE) is None


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    return build_checkpoints(tmp_path_factory.mktemp("gpt-oss"))[2]


def _with_scale(source, target, byte: int) -> str:
    """A copy of the MXFP4 checkpoint ``source`` at ``target`` whose TENSOR has one byte set."""
    from safetensors.torch import load_file, save_file

    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")
    state = load_file(str(source / "model.safetensors"))
    state[TENSOR] = state[TENSOR].clone()
    state[TENSOR][3, 17, 1] = byte
    save_file(state, str(target / "model.safetensors"))
    return str(target)


def _load_each(rank: int, world: int, cases: list) -> list:
    """For each (path, form, dtype): None when the model loads, else the error's text."""
    import dataclasses

    from arfusion.engine.models.registry import build_model
    from arfusion.engine.weights.safetensors_loader import load_safetensors
    from tests.dist_utils import make_fusion

    messages = []
    for path, form, dtype in cases:
        config, weights = load_safetensors(path, dtype)
        config = dataclasses.replace(config, keep_mxfp4=form != "dequantize",
                                     mxfp4_tensor_cores=form == "tensor-cores")
        model = build_model(config, make_fusion(config.hidden_size, dtype), dtype)
        try:
            model.load_weights(weights)
            messages.append(None)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_each_form_refuses_the_scales_its_kernels_cannot_decode(mxfp4_dir, tmp_path):
    cases = {(240, "keep", torch.float32): None,
             (241, "keep", torch.float32): "2^114, exceeds 2^113",
             (255, "keep", torch.float32): "1 of its 1024 scale bytes are 255, E8M0's NaN",
             (128, "tensor-cores", torch.float32): None,
             (129, "tensor-cores", torch.float32): "2^2, exceeds 2^1",
             (255, "dequantize", torch.float32): "1 of its 1024 scale bytes are 255, E8M0's NaN",
             (250, "dequantize", torch.float32): None,
             (250, "dequantize", torch.float16): "(largest 2^123) put"}
    paths = {byte: _with_scale(mxfp4_dir, tmp_path / str(byte), byte) for byte in {b for b, _, _ in cases}}
    got = run_distributed(_load_each, world_size=1, args=([(paths[b], form, dtype) for b, form, dtype in cases],),
                          timeout_s=120)[0]
    for (byte, form, dtype), message, expected in zip(cases, got, cases.values()):
        if expected is None:
            assert message is None, (byte, form, message)
            continue
        assert message is not None and expected in message and TENSOR in message and "\n" not in message, \
            (byte, form, message)
        if dtype == torch.float16:
            assert "past the range of float16; load it in a wider --dtype" in message
        if form == "keep" and byte != NAN_SCALE:
            assert "--mxfp4-experts dequantize" in message
        if form == "tensor-cores":
            assert "--mxfp4-experts keep" in message and "--mxfp4-experts dequantize" in message
