"""arfusion's SGLang plugin against SGLang's real code (CPU; skipped where SGLang is not
installed: integrations/sglang/ci.sh makes the venv that has it)."""
from __future__ import annotations

import inspect
import logging
import pkgutil
from importlib import metadata

import pytest
import torch

pytest.importorskip("sglang.srt.plugins.hook_registry", reason="SGLang is not installed (integrations/sglang/ci.sh)")

from arfusion.integrations.sglang import hooks, layer_scope, plugin  # noqa: E402
from arfusion.integrations.sglang.versions import SGLangVersionError, check_sglang_version  # noqa: E402
from tests.sglang import scenarios  # noqa: E402
from tests.sglang.ranks import run_two_ranks  # noqa: E402
from tests.tolerances import TOLERANCES  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def test_entry_point_is_registered_for_sglang():
    eps = [ep for ep in metadata.entry_points(group="sglang.srt.plugins") if ep.name == "arfusion"]
    assert [ep.value for ep in eps] == ["arfusion.integrations.sglang.plugin:register"]
    assert eps[0].load() is plugin.register


@pytest.mark.parametrize("version,ok", [("0.5.10.post1", False), ("0.5.11", True), ("0.5.13.post1", True),
                                        ("0.5.17", True), ("0.5.18", False), ("0.6.0", False), ("dev", False)])
def test_version_bounds(version, ok):
    if ok:
        assert check_sglang_version(version) == version
    else:
        with pytest.raises(SGLangVersionError) as err:
            check_sglang_version(version)
        assert "\n" not in str(err.value) and version in str(err.value) and "0.5.11 to 0.5.17" in str(err.value)


def test_installed_sglang_is_supported():
    check_sglang_version()


def test_off_without_the_option(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.delenv(plugin.ENV, raising=False)
    before = {t: list(h) for t, h in HookRegistry._hooks.items()}
    plugin.register()
    assert {t: list(h) for t, h in HookRegistry._hooks.items()} == before
    monkeypatch.setenv(plugin.ENV, "yes")
    with pytest.raises(ValueError, match="ARFUSION_SGLANG must be 1"):
        plugin.register()


def test_every_target_exists_in_sglang():
    for target, _, _ in hooks.HOOKS + hooks.OPTIONAL_HOOKS:
        assert callable(pkgutil.resolve_name(target)), target


def test_fused_call_keeps_sglangs_signature():
    """SGLang registers its fused call as the torch op ``sglang::flashinfer_allreduce_residual_rmsnorm``:
    ours takes the same arguments, in the same order, with the same defaults."""
    import sglang.srt.layers.flashinfer_comm_fusion as fc

    schema = torch.ops.sglang.flashinfer_allreduce_residual_rmsnorm.default._schema
    theirs = [(a.name, a.default_value) for a in schema.arguments]
    ours = [(p.name, None if p.default is inspect.Parameter.empty else p.default)
            for p in inspect.signature(hooks.allreduce_residual_rmsnorm).parameters.values()]
    assert ours == theirs

    def params(fn):
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]

    assert params(hooks.pre_initialize_workspaces) == params(fc.pre_initialize_workspaces)


def test_layer_scope_keys_prepare_attn_on_the_previous_layer():
    class Communicator:
        pass

    a, b = Communicator(), Communicator()
    layer_scope.number_communicator(None, a)
    layer_scope.number_communicator(None, b)
    seen = []
    layer_scope.own_layer(lambda c: seen.append(layer_scope.current()), b)
    layer_scope.previous_layer(lambda c: seen.append(layer_scope.current()), b)
    assert seen == [layer_scope.layer_id(b), layer_scope.layer_id(a)] and layer_scope.layer_id(b) == layer_scope.layer_id(a) + 1
    assert layer_scope.current() == 0


def test_sglang_applies_our_hooks():
    for patched in run_two_ranks(scenarios.hooks_applied):
        assert {t for t, _, _ in hooks.HOOKS + hooks.OPTIONAL_HOOKS} <= set(patched)


def test_fused_call_matches_sglangs_unfused_path_on_two_ranks():
    ranks = run_two_ranks(scenarios.fused_matches_unfused)
    for rank_cases in ranks:
        assert len(rank_cases) == 6
        for dtype, tokens, out in rank_cases:
            assert out["op_reductions"].item() == 1, (dtype, tokens)  # our op ran it, once
            rtol, atol = TOLERANCES[out["ref_normed"].dtype]
            torch.testing.assert_close(out["residual"], out["ref_residual"], rtol=rtol, atol=atol)
            torch.testing.assert_close(out["normed"], out["ref_normed"], rtol=rtol, atol=atol)
    torch.testing.assert_close(ranks[0][0][2]["normed"], ranks[1][0][2]["normed"], rtol=0, atol=0)


def test_every_fallback_still_reduces():
    for result in run_two_ranks(scenarios.fallbacks):
        for name, ((normed, residual), (ref_normed, ref_residual)) in result["cases"].items():
            torch.testing.assert_close(residual, ref_residual, rtol=1e-5, atol=1e-5, msg=name)
            torch.testing.assert_close(normed, ref_normed, rtol=1e-5, atol=1e-5, msg=name)
        assert result["nccl_strategy_runs"] == 1  # 100 tokens > 64: the op's own NCCL strategy
        assert result["unfused_by_plugin"] == {"tensors not contiguous": 1,
                                               "shape, dtype or device the op was not made for": 1,
                                               "no fusion op (SGLang did not pre-initialise its workspace)": 1}


def test_gate_and_workspace_life_cycle():
    for result in run_two_ranks(scenarios.gate_and_lifecycle):
        assert result["before_pre_init"] and result["created"] and result["destroyed"]
        assert result["sglang_gate_on_cpu"] is False  # SGLang's own conditions: no sm90 GPU here
        # beyond flashinfer's 2048 tokens up to what our op holds; none for an empty batch
        assert result["gate"] == {0: False, 1: True, 8: True, 3000: True, 4096: True, 4097: False}
        assert result["new_layer_misses"] == 1  # keyed on (layer, batch): a new layer is one miss, then a hit
        assert result["gate_after_cleanup"] is False


def test_version_error_reaches_sglangs_loader_as_one_line(monkeypatch, caplog):
    """Outside the supported releases SGLang's own loader reports our one-line error and applies
    none of our hooks (the installed release stands in for a newer one)."""
    import sglang.srt.plugins as plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setenv(plugin.ENV, "1")
    monkeypatch.setattr(plugin, "check_sglang_version", lambda: check_sglang_version("0.5.23"))
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.setenv("SGLANG_PLUGINS", "arfusion")
    before = {t: list(h) for t, h in HookRegistry._hooks.items()}
    with caplog.at_level(logging.INFO):
        plugins.load_plugins()
    failed = [r for r in caplog.records if "Failed to execute general plugin" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is not None
    message = str(failed[0].exc_info[1])
    assert isinstance(failed[0].exc_info[1], SGLangVersionError) and "\n" not in message
    assert "supports sglang 0.5.11 to 0.5.17, found 0.5.23" in message
    assert {t: list(h) for t, h in HookRegistry._hooks.items()} == before


def test_a_stalled_peer_fails_the_step(monkeypatch):
    """After ``ModelRunner.forward`` the op's bounded-wait check runs: a timed-out kernel fails
    the step with a named error."""
    from arfusion.fusion import FusionTimeoutError
    from arfusion.integrations.sglang import runtime

    class TimedOutOp:  # stands in for an op whose Lamport kernel gave up waiting (that needs a GPU)
        def raise_if_failed(self) -> None:
            raise FusionTimeoutError("lamport_one_shot: rank 0 waited more than 1000 ms for rank 1's rows")

    monkeypatch.setattr(runtime, "_op", TimedOutOp())
    with pytest.raises(FusionTimeoutError, match="rank 1's rows"):
        hooks.raise_if_peer_stalled(None)
    monkeypatch.setattr(runtime, "_op", None)
    assert hooks.raise_if_peer_stalled(None) is None
