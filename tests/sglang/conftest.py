"""The SGLang plugin's tests run against SGLang's real modules where SGLang is installed (the
venv of integrations/sglang/ci.sh); without it every test here skips (importorskip per module).

One stand-in, named here with its reason: ``fake_torchvision``. SGLang's modules import
torchvision at module level (image decoding, transforms); PyPI's torchvision wheels are built
against CUDA torch and their C extension cannot load beside the CPU torch of these tests. The
code under test never touches images.
"""
import importlib.util
import os
import sys

FAKE_TORCHVISION = os.path.join(os.path.dirname(__file__), "fake_torchvision")

if importlib.util.find_spec("sglang") is not None and FAKE_TORCHVISION not in sys.path:
    sys.path.insert(0, FAKE_TORCHVISION)
