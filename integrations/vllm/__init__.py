"""arfusion inside vLLM, no fork: a post-grad compile pass that replaces vLLM's all-reduce +
(residual add +) RMSNorm by arfusion's fused op and its cached dispatch.

    fusion_pass  the pass (``PASS_NAME``, given to ``compilation_config.inductor_passes``)
    matching     which graph nodes form a site
    collectives  the forms an all-reduce takes in vLLM's graph; what counts as a collective
    config_check vLLM settings that would leave the pass nothing to do (refused or reported)
    ops          the torch custom ops the pass inserts (fake + real implementations)
    runtime      the fusion ops they run, made over vLLM's TP group on first use; counters
    versions     the supported vLLM releases

`register` is the ``vllm.general_plugins`` entry point (vLLM calls it in every process: the
front end, the engine core and each worker): it registers the custom ops, so that a compiled
graph that holds them loads from vLLM's cache, warns once when this vLLM is outside the
supported range (the pass itself refuses to load there) and, inside it, has every engine config
that names the pass checked (`config_check`: vLLM's own ``fuse_allreduce_rms`` refused, eager
mode reported).
"""
from __future__ import annotations

import logging

PASS_NAME = "arfusion.integrations.vllm.fusion_pass.ARFUSION_PASS"
logger = logging.getLogger(__name__)


def register() -> None:
    """The ``vllm.general_plugins`` entry point (module docstring)."""
    from arfusion.integrations.vllm import ops  # noqa: F401  (registers torch.ops.arfusion.*)
    from arfusion.integrations.vllm.config_check import watch_engine_config
    from arfusion.integrations.vllm.versions import VllmVersionError, check_vllm_version, installed_vllm_version

    try:
        check_vllm_version(installed_vllm_version())
    except VllmVersionError as exc:
        logger.warning("%s", exc)
        return
    watch_engine_config(PASS_NAME)
