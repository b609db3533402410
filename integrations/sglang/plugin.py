"""The entry point SGLang calls in every process (``sglang.srt.plugins``, ``load_plugins()``):
with ``ARFUSION_SGLANG=1`` it checks SGLang's version and registers the hooks of
`integrations.sglang.hooks` (SGLang applies them right after, ``HookRegistry.apply_hooks()``).
They take effect where SGLang's own fused path would run, i.e. with SGLang's
``--enable-flashinfer-allreduce-fusion``; without ``ARFUSION_SGLANG=1`` nothing is registered.
"""
from __future__ import annotations

import logging
import os
import pkgutil

from arfusion.integrations.sglang.hooks import HOOKS, OPTIONAL_HOOKS
from arfusion.integrations.sglang.versions import check_sglang_version

logger = logging.getLogger(__name__)
ENV = "ARFUSION_SGLANG"


def enabled() -> bool:
    """``ARFUSION_SGLANG`` is ``1`` (``0`` or unset: off; any other value is an error)."""
    value = os.environ.get(ENV, "0").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"{ENV} must be 1 (on) or 0 (off), got {value!r}")
    return value == "1"


def _exists(target: str) -> bool:
    """Whether the installed SGLang has ``target`` (a dotted module.attribute path)."""
    try:
        pkgutil.resolve_name(target)
    except (ImportError, AttributeError):
        return False
    return True


def register() -> None:
    """Register arfusion's hooks with SGLang's ``HookRegistry`` (when ``ARFUSION_SGLANG=1``).
    Raises `integrations.sglang.versions.SGLangVersionError` (one line) outside the supported
    SGLang releases."""
    if not enabled():
        logger.debug("arfusion's SGLang plugin is installed but off (%s is not 1)", ENV)
        return
    version = check_sglang_version()
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooks = HOOKS + [h for h in OPTIONAL_HOOKS if _exists(h[0])]
    for target, hook, kind in hooks:
        HookRegistry.register(target, hook, HookType[kind])
    logger.info("arfusion's SGLang plugin: %d hooks registered on sglang %s", len(hooks), version)
