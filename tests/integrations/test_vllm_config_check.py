"""The vLLM configs in which arfusion's pass would replace nothing: vLLM's own all-reduce + RMSNorm
fusion is refused, a run without Inductor is reported. The check itself needs no vLLM (a config
stand-in); the last test builds real engine configs and needs vLLM (``bash integrations/vllm/ci.sh``)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from arfusion.integrations.vllm import PASS_NAME
from arfusion.integrations.vllm.config_check import VllmConfigError, check, names_our_pass


def _config(fuse_allreduce_rms, mode="VLLM_COMPILE", backend="inductor"):
    cc = SimpleNamespace(pass_config=SimpleNamespace(fuse_allreduce_rms=fuse_allreduce_rms),
                         mode=SimpleNamespace(name=mode), backend=backend,
                         inductor_passes={"post_grad_custom_post_pass": PASS_NAME}, inductor_compile_config={})
    return SimpleNamespace(compilation_config=cc)


def test_vllms_own_fusion_is_refused_with_the_fix():
    with pytest.raises(VllmConfigError, match="'fuse_allreduce_rms': False") as info:
        check(_config(True))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("mode, backend, warned", [("VLLM_COMPILE", "inductor", False), ("DYNAMO_TRACE_ONCE", "inductor", False),
                                                   ("NONE", "inductor", True), ("DYNAMO_TRACE_ONCE", "eager", True)])
def test_a_run_without_inductor_is_reported(caplog, mode, backend, warned):
    with caplog.at_level(logging.WARNING, logger="arfusion.integrations.vllm.config_check"):
        check(_config(None, mode, backend))  # None: vLLM's default left unset
    assert ("arfusion's pass never runs, no all-reduce is replaced" in caplog.text) == warned


def test_only_configs_that_name_the_pass_are_checked():
    config = _config(True)
    assert names_our_pass(config, PASS_NAME)
    config.compilation_config.inductor_passes = {}
    assert not names_our_pass(config, PASS_NAME)


@pytest.mark.parametrize("settings, refused, warned", [
    ({"compilation_config": {"mode": 3, "pass_config": {"fuse_allreduce_rms": True}}}, True, False),
    ({"compilation_config": {"mode": 3}, "enforce_eager": True}, False, True),
    ({"compilation_config": {"mode": 3}}, False, False),
], ids=["own-fusion", "eager", "compiled"])
def test_vllm_engine_configs_are_checked_when_built(tmp_path, caplog, settings, refused, warned):
    pytest.importorskip("vllm", reason="vLLM is not installed here; bash integrations/vllm/ci.sh runs this test")
    from vllm.engine.arg_utils import EngineArgs

    from tests.integrations.vllm_tp2_run import write_model

    model = write_model(tmp_path / "model")
    compilation = settings["compilation_config"] | {"inductor_passes": {"post_grad_custom_post_pass": PASS_NAME}}
    args = EngineArgs(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128,
                      **(settings | {"compilation_config": compilation}))
    with caplog.at_level(logging.WARNING, logger="arfusion.integrations.vllm.config_check"):
        if refused:
            with pytest.raises(VllmConfigError, match="fuse_allreduce_rms"):
                args.create_engine_config()
        else:
            args.create_engine_config()
    assert ("arfusion's pass never runs" in caplog.text) == warned
