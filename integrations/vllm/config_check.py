"""What a vLLM configuration that names arfusion's pass must not hide: checked once the
configuration is final.

* vLLM's own all-reduce + RMSNorm fusion (``compilation_config.pass_config.fuse_allreduce_rms``,
  on by default on Hopper and Blackwell from 0.2x) runs before the post-grad custom pass and takes
  every site: arfusion's pass would then replace nothing. Refused with `VllmConfigError`, which
  says how to turn it off.
* Without Inductor (``enforce_eager=True``, ``compilation_config.mode`` 0 / NONE,
  ``TORCH_COMPILE_DISABLE=1``, or a backend other than Inductor) vLLM never runs a post-grad
  pass: a warning says that arfusion replaces nothing.

`watch_engine_config` makes vLLM run the check: it wraps ``EngineArgs.create_engine_config`` (the
one place where ``LLM(...)`` and ``vllm serve`` build their config), so the check runs in the
process that builds the config, before any worker starts. The pass itself checks again when it
is called (`refuse_own_fusion`), for configurations built elsewhere.
"""
from __future__ import annotations

import functools
import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)


class VllmConfigError(ValueError):
    """A vLLM configuration in which arfusion's pass cannot do its work (one line, with the fix)."""


def names_our_pass(vllm_config: Any, pass_name: str) -> bool:
    """The configuration asks for arfusion's pass (by its dotted name or as the object)."""
    ours = getattr(sys.modules.get("arfusion.integrations.vllm.fusion_pass"), "ARFUSION_PASS", None)
    cc = vllm_config.compilation_config
    return pass_name in cc.inductor_passes.values() or (
        ours is not None and any(v is ours for v in cc.inductor_compile_config.values()))


def refuse_own_fusion(vllm_config: Any) -> None:
    """`VllmConfigError` when vLLM's own all-reduce + RMSNorm fusion is on (module docstring)."""
    if getattr(vllm_config.compilation_config.pass_config, "fuse_allreduce_rms", False):
        raise VllmConfigError(
            "arfusion's pass and vLLM's own fuse_allreduce_rms both replace all-reduce + RMSNorm, and vLLM's runs "
            "first and takes every site; turn vLLM's off: compilation_config={'pass_config': "
            "{'fuse_allreduce_rms': False}, ...} (--compilation-config.pass_config.fuse_allreduce_rms false), "
            "or remove arfusion's pass")


def check(vllm_config: Any) -> None:
    """`refuse_own_fusion`; then a warning when vLLM will run no Inductor post-grad pass (mode
    NONE, or a backend other than Inductor): the pass replaces nothing. For configs that name the pass."""
    refuse_own_fusion(vllm_config)
    cc = vllm_config.compilation_config
    mode = getattr(cc.mode, "name", str(cc.mode))
    if mode == "NONE" or cc.backend not in ("inductor", ""):
        logger.warning("arfusion: vLLM runs this model without Inductor (compilation mode %s, backend %r; "
                       "enforce_eager, mode 0, TORCH_COMPILE_DISABLE=1 or VLLM_CPU_CI_ENV): arfusion's pass never "
                       "runs, no all-reduce is replaced", mode, cc.backend)


def watch_engine_config(pass_name: str) -> None:
    """Make ``EngineArgs.create_engine_config`` run `check` on every config it returns that names
    the pass ``pass_name`` (idempotent: wrapped once per process)."""
    from vllm.engine.arg_utils import EngineArgs

    build = EngineArgs.create_engine_config
    if getattr(build, "_arfusion_checked", False):
        return

    @functools.wraps(build)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = build(self, *args, **kwargs)
        if names_our_pass(config, pass_name):
            check(config)
        return config

    create_engine_config._arfusion_checked = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]
