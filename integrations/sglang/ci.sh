#!/usr/bin/env bash
# The SGLang plugin's tests against SGLang's real code, on CPU: a venv of its own (.venv-sglang,
# ignored by git) with the CPU torch, arfusion, SGLang's wheel WITHOUT its dependencies (they
# pin a CUDA torch) and only the pure-Python packages that the imported SGLang modules need.
# Run from anywhere: bash integrations/sglang/ci.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
SGLANG_VERSION=${SGLANG_VERSION:-0.5.17}
VENV=.venv-sglang
start=$SECONDS
[ -x "$VENV/bin/python" ] || python -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0 -e '.[test]'
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
# what `import sglang.srt.layers.communicator` (and the modules it pulls in) needs, pinned where
# SGLang or transformers pin it; torchvision is not installed (tests/sglang/conftest.py says why)
"${PIP[@]}" --no-deps orjson psutil pybase64 triton ipython traitlets pyzmq msgspec einops regex dill \
  openai sniffio partial_json_parser xgrammar sentencepiece compressed-tensors loguru \
  "apache-tvm-ffi==0.1.11" "transformers==5.12.1" "tokenizers==0.22.2" "huggingface-hub>=1.5,<2"
# `.[test]`'s newest transformers brought `kernels`, whose API transformers 5.12.1 predates (its
# import fails on "Either a revision or a version must be specified"); 5.12.1 does not need it
"$VENV/bin/pip" uninstall -q -y kernels
echo "set-up: $((SECONDS - start)) s"
"$VENV/bin/python" -m pytest tests/sglang -q -p no:cacheprovider
echo "set-up + tests: $((SECONDS - start)) s"
