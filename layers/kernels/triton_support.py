"""Whether the Triton kernels of this package can be used (triton imports), asked once."""
import functools


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
