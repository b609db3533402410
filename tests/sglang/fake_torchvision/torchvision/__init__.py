"""A stand-in for torchvision in the SGLang plugin tests (only there: tests/sglang/conftest.py
puts it on sys.path).

SGLang's modules (and the transformers they import) import torchvision at module level for image
decoding and transforms. PyPI's torchvision wheels are built against CUDA torch, and their C
extension cannot load beside the CPU torch of these tests (importing them fails with ``operator
torchvision::nms does not exist``). The plugin's code paths never touch images: here every
``torchvision.*`` module exists, every name in it is a class that raises when it is used.
"""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stand-in"


class _Meta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _unavailable(f"{cls.__qualname__}.{name}")


def _unavailable(name: str) -> type:
    def fail(*args, **kwargs):
        raise RuntimeError(f"torchvision is a test stand-in here: {name} is not available")
    return _Meta(name.rsplit(".", 1)[-1], (), {"__init__": fail, "__call__": fail, "__qualname__": name})


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _unavailable(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__path__ = []  # a package: submodules come from _Finder
