"""The vLLM plugin's version bounds: the check needs no vLLM, so it runs in the main suite."""
import pytest

from arfusion.integrations.vllm.versions import SUPPORTED, VllmVersionError, check_vllm_version, parse_version


@pytest.mark.parametrize("version", ["0.20.0", "0.23.1", "0.26.0", "0.27.0", "0.27.1+cpu", "0.21.0rc2", "0.32.0"])
def test_supported_versions_pass(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.19.1", "0.33.0", "1.0.0", "0.9.2"])
def test_versions_outside_the_range_fail_in_one_line_naming_both(version):
    with pytest.raises(VllmVersionError) as info:
        check_vllm_version(version)
    message = str(info.value)
    assert "\n" not in message and version in message and SUPPORTED in message


def test_an_unreadable_version_is_named():
    with pytest.raises(VllmVersionError, match="'dev'"):
        parse_version("dev")
    assert parse_version("0.27.0+cpu") == (0, 27)
